"""The test helpers' own rules: how pytest-xdist workers take turns with a `serial` test, and
how the fork server (tests/zygote.py) starts `python -m predictor` as a new interpreter would."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import (
    EXPORTED_TOKENIZER,
    REPO,
    TOKENIZER_FILES,
    ForkedProcess,
    ForkServer,
    ServerProcess,
    built_once,
    fork_server,
    save_tokenizer,
    taking_turns,
)


def _hold(folder: Path, alone: bool, seconds: float, log: list[tuple[str, float, float]]) -> None:
    with taking_turns(folder, alone):
        start = time.monotonic()
        time.sleep(seconds)
        log.append(("alone" if alone else "shared", start, time.monotonic()))


def test_tests_share_turns_and_a_serial_one_runs_alone(tmp_path: Path) -> None:
    """Each thread opens the lock files itself, as a worker process does (flock locks belong to
    an open file): two shared holders overlap, the one alone overlaps nobody."""
    log: list[tuple[str, float, float]] = []
    threads = [threading.Thread(target=_hold, args=(tmp_path, False, 0.3, log)) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.1)  # both shared turns are held: the one alone must wait for them
    alone = threading.Thread(target=_hold, args=(tmp_path, True, 0.3, log))
    alone.start()
    time.sleep(0.1)  # it waits at the lock, holding the turnstile: a later shared turn waits too
    late = threading.Thread(target=_hold, args=(tmp_path, False, 0.1, log))
    late.start()
    for thread in [*threads, alone, late]:
        thread.join(timeout=10)
    assert [kind for kind, _, _ in log] == ["shared", "shared", "alone", "shared"]
    (_, s1, e1), (_, s2, e2), (_, a_start, a_end), (_, l_start, _) = log
    assert max(s1, s2) < min(e1, e2)  # the two shared turns overlapped
    assert a_start >= max(e1, e2) - 0.01  # the one alone began after both had ended
    assert l_start >= a_end - 0.01  # and the late shared turn after it


@pytest.fixture(scope="module")
def forks() -> Iterator[ForkServer]:
    """The test process's own fork server, which `make test` starts with each worker (its
    imports are a server start's: seconds); one of the module's where that one is off."""
    shared = fork_server()
    if shared is not None:
        yield shared
        return
    server = ForkServer()
    yield server
    server.close()


def test_a_shared_model_is_built_by_one_worker_and_again_after_a_failure(tmp_path: Path) -> None:
    out, builds = tmp_path / "model", []

    def failing(folder: Path) -> None:
        raise RuntimeError("the build failed")

    def build(name: str) -> None:
        def make(folder: Path) -> None:
            builds.append(name)
            time.sleep(0.2)  # the other one waits meanwhile, then finds it built
            folder.mkdir()

        assert built_once(out, make) == out

    with pytest.raises(RuntimeError):
        built_once(out, failing)
    workers = [threading.Thread(target=build, args=(f"w{i}",)) for i in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(builds) == 1 and out.is_dir()
    built_once(out, failing)  # built: not called again


def test_the_tokenizer_is_copied_from_the_export_where_make_model_wrote_it(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    exported = tmp_path / "exported"
    exported.mkdir()
    for name in TOKENIZER_FILES:
        (exported / name).write_text(f"{name} as make model wrote it")
    copied = save_tokenizer(tmp_path / "copied", exported=exported)
    assert {p.name: p.read_text() for p in copied.iterdir()} == {
        p.name: p.read_text() for p in exported.iterdir()
    }
    if all((EXPORTED_TOKENIZER / name).is_file() for name in TOKENIZER_FILES):
        real = AutoTokenizer.from_pretrained(save_tokenizer(tmp_path / "real"))
        assert "<|im_start|>" in real.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                          tokenize=False)  # fmt: skip


def test_a_forked_predictor_gets_its_arguments_environment_and_log(
    forks: ForkServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "help.log"
    process = forks.launch(["-m", "predictor", "--help"], REPO, log)
    assert isinstance(process, ForkedProcess) and process.pid != os.getpid()
    assert process.wait(60) == 0
    assert "--model-dir" in log.read_text()  # argparse's help, on the log file
    bad = forks.launch(["-m", "predictor", "--no-such-flag"], REPO, tmp_path / "bad.log")
    assert bad.wait(60) == 2  # argparse's usage error, as from a new interpreter
    assert "--no-such-flag" in (tmp_path / "bad.log").read_text()
    monkeypatch.setenv("PREDICTOR_MAX_BATCH_SIZE", "not-a-number")  # the launch's environment
    env = forks.launch(["-m", "predictor", "--model-dir", str(tmp_path)], REPO, tmp_path / "e")
    assert env.wait(60) == 2
    assert "PREDICTOR_MAX_BATCH_SIZE='not-a-number'" in (tmp_path / "e").read_text()


def test_a_forked_server_serves_and_its_signalled_end_is_reported(
    tiny_gptq_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if fork_server() is None:
        pytest.skip("PREDICTOR_TEST_FORK=0: servers are new interpreters")
    with ServerProcess.start(tiny_gptq_dir, "tiny") as srv:
        assert isinstance(srv.process, ForkedProcess)  # `make test`'s servers are forked
        # its log is in the run's folder, which pytest prunes, not in the system's temp folder
        assert srv.log_path.parent.name == "logs" and srv.log().strip()
        assert tmp_path_factory.getbasetemp().parent in srv.log_path.parents
        ready = httpx.get(f"{srv.base_url}/v2/health/ready", timeout=10)
        assert ready.status_code == 200
        assert srv.process.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            srv.process.wait(0.1)
        srv.process.kill()
        assert srv.process.wait(60) == -signal.SIGKILL
        assert srv.process.poll() == -signal.SIGKILL


def test_anything_else_starts_a_new_interpreter(forks: ForkServer, tmp_path: Path) -> None:
    process = forks.launch(["-c", "print('fresh')"], REPO, tmp_path / "c.log")
    assert isinstance(process, subprocess.Popen)
    assert process.wait(60) == 0 and (tmp_path / "c.log").read_text() == "fresh\n"
    other_tree = forks.launch(["-m", "predictor", "--help"], tmp_path, tmp_path / "t.log")
    assert isinstance(other_tree, subprocess.Popen)
    other_tree.wait(60)
