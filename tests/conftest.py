"""Session fixtures: a tokenizer, a tiny random Llama (fp32) and its GPTQ 4-bit twin, servers."""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from predictor.model.env import prepare_environment

# The test process is an edge too: pin what the libraries would otherwise pick for themselves,
# as the model tools do (the tiny models are quantized here), with a cache of the tests' own.
prepare_environment(os.environ, Path(tempfile.gettempdir()) / "gptq-predictor-hf")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from tests.support import (  # noqa: E402
    LOG_FOLDER_VARIABLE,
    TUNE_CACHE_VARIABLE,
    ServerProcess,
    build_tiny_dense,
    build_tiny_gptq,
    built_once,
    fork_server,
    save_tokenizer,
    taking_turns,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "smollm2-135m-instruct-gptq"


def _turns(item: pytest.Item) -> Path | None:
    """Where the pytest-xdist workers of this run (`make test`) take turns: the run's own temp
    folder, which holds each worker's and which pytest prunes; None in a plain pytest."""
    if getattr(item.config, "workerinput", None) is None:
        return None
    return _run_folder(item.config)


def _run_folder(config: pytest.Config) -> Path:
    """The run's own temp folder: the one pytest-xdist's workers share (each has a folder in
    it), or a plain pytest's; pytest prunes it."""
    factory: pytest.TempPathFactory = config._tmp_path_factory  # what tmp_path_factory is
    base = factory.getbasetemp()
    return base.parent if getattr(config, "workerinput", None) is not None else base


def pytest_sessionstart(session: pytest.Session) -> None:
    """The run's servers and in-process runners (tests.support.tune_cache) keep their kernel
    choices and compiled matmuls in one folder of the run's: measured or compiled once for all
    of the run's processes, and nothing read from or left in the user's cache; the servers'
    logs go to another, which pytest prunes with the run's folder. A
    pytest-xdist worker (`make test`) then starts its fork server: it imports the servers'
    modules (seconds) while the session's tiny models are built, before the first server."""
    os.environ[TUNE_CACHE_VARIABLE] = str(_run_folder(session.config) / "autotune")
    os.environ[LOG_FOLDER_VARIABLE] = str(_run_folder(session.config) / "logs")
    if getattr(session.config, "workerinput", None) is not None:
        fork_server()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported lives as long as the test process: out of the collector's sight,
    as in the servers (predictor/__main__.py) and the fork server, so that the full collection
    gptqmodel runs at each checkpoint load walks only what the tests made."""
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under pytest-xdist, a test holds a shared turn for its setup, call and teardown (module
    fixtures included), unless it is marked `serial`: see pytest_runtest_call."""
    folder = _turns(item)
    if folder is None or item.get_closest_marker("serial") is not None:
        yield
        return
    with taking_turns(folder, alone=False):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test marked `serial` runs its call, the part it times, while the other workers wait
    between tests; its fixtures start and stop beside their tests."""
    folder = _turns(item)
    if folder is None or item.get_closest_marker("serial") is None:
        yield
        return
    with taking_turns(folder, alone=True):
        yield


@pytest.fixture(scope="session")
def workdir(request: pytest.FixtureRequest) -> Path:
    """The session's models: one folder of the run's, for all its pytest-xdist workers, each
    model built by the first worker that needs it (built_once)."""
    folder = _run_folder(request.config) / "models"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def tokenizer_dir(workdir: Path) -> Path:
    return built_once(workdir / "tokenizer", save_tokenizer)


@pytest.fixture(scope="session")
def tiny_dense_dir(workdir: Path, tokenizer_dir: Path) -> Path:
    return built_once(workdir / "tiny-dense", lambda out: build_tiny_dense(out, tokenizer_dir))


@pytest.fixture(scope="session")
def tiny_gptq_dir(workdir: Path, tiny_dense_dir: Path) -> Path:
    return built_once(workdir / "tiny-gptq", lambda out: build_tiny_gptq(tiny_dense_dir, out))


@pytest.fixture(scope="session")
def tiny_bf16_dir(workdir: Path, tokenizer_dir: Path) -> Path:
    """A random-weight GPTQ checkpoint of the tiny shape with bf16 tensors (the CPU's native
    attention and layer kernels serve it), written directly: no quantization run."""
    from load.random_gptq import SHAPES, Layout, write_checkpoint

    return built_once(
        workdir / "tiny-gptq-bf16",
        lambda out: write_checkpoint(out, SHAPES["tiny"], Layout(4, 32), tokenizer_dir, seed=11),
    )


@pytest.fixture(scope="session")
def server(tiny_gptq_dir: Path) -> Iterator[ServerProcess]:
    """The real predictor (`python -m predictor`) on the tiny GPTQ model, on loopback ports."""
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=["--max-tokens-limit", "512"]) as proc:
        yield proc


# The in-process tiny models (tests/engine/conftest.py) serve tests outside engine/ too.
from tests.engine.conftest import tiny_dense, tiny_gptq  # noqa: E402, F401
