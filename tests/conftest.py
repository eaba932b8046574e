"""Session fixtures: a tokenizer, a tiny random Llama (fp32) and its GPTQ 4-bit twin, servers."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# The test process is an edge too: pin what the libraries would otherwise pick for themselves.
os.environ.setdefault("HF_HOME", str(Path(tempfile.gettempdir()) / "gptq-predictor-hf"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

from tests.support import ServerProcess, build_tiny_dense, build_tiny_gptq, save_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "smollm2-135m-instruct-gptq"


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tokenizer_dir(workdir: Path) -> Path:
    return save_tokenizer(workdir / "tokenizer")


@pytest.fixture(scope="session")
def tiny_dense_dir(workdir: Path, tokenizer_dir: Path) -> Path:
    return build_tiny_dense(workdir / "tiny-dense", tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_gptq_dir(workdir: Path, tiny_dense_dir: Path) -> Path:
    return build_tiny_gptq(tiny_dense_dir, workdir / "tiny-gptq")


@pytest.fixture(scope="session")
def server(tiny_gptq_dir: Path) -> Iterator[ServerProcess]:
    """The real predictor (`python -m predictor`) on the tiny GPTQ model, on loopback ports."""
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=["--max-tokens-limit", "512"]) as proc:
        yield proc


# The in-process tiny models (tests/engine/conftest.py) serve tests outside engine/ too.
from tests.engine.conftest import tiny_dense, tiny_gptq  # noqa: E402, F401
