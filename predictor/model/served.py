"""A checkpoint scored as the server serves it: `python -m predictor` started on it (its default
kernels, the autotune's choice: int8 activations where they win, native attention; or a kernel
named), a text's tokens sent to OpenAI completions with `echo` and `logprobs`, its perplexity
read back, and a short generation timed.

evaluate.py scores a checkpoint in process, dequantized exactly in fp32 or through gptqmodel's
kernel; what a client gets can differ by the serving kernels' own rounding. The quantize
command's gate holds this figure to the same bar. Only a subprocess and HTTP: the model builder
imports nothing of the engine or the server.
"""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

NAME = "gate"  # the name the checkpoint is served under for the measurement


SPEED_TOKENS = 64  # generated after the perplexity request, timed: the kernels' decode speed


def served_figures(
    checkpoint: Path,
    ids: list[int],
    threads: int = 1,
    ready_timeout: float = 900.0,
    kernel: str | None = None,
) -> dict[str, float]:
    """The served model's perplexity on `ids` (exp of the mean negative log-likelihood of
    ids[1:] given what precedes each, from its prompt logprobs: one request, the whole sequence
    as one context) and its decode speed (SPEED_TOKENS greedy tokens after a short prompt,
    tokens a second), with its default kernels or `--kernel kernel`."""
    http, grpc = _free_port(), _free_port()
    flags = {
        "--model-dir": str(checkpoint),
        "--model-name": NAME,
        "--http-port": str(http),
        "--grpc-port": str(grpc),
        "--threads": str(threads),
        "--max-tokens-limit": str(SPEED_TOKENS),
        "--default-max-tokens": "16",
        "--max-prompt-tokens": str(len(ids)),
        "--speculative": "off",
    }
    if kernel is not None:
        flags["--kernel"] = kernel
    arguments = [part for flag in flags.items() for part in flag]
    command = [sys.executable, "-m", "predictor", *arguments]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            base = f"http://127.0.0.1:{http}"
            _wait_ready(process, f"{base}/v2/health/ready", ready_timeout, log)
            answer = _post(
                base, {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}, ready_timeout
            )
            started = time.monotonic()
            _post(
                base,
                {"prompt": ids[:16], "max_tokens": SPEED_TOKENS, "ignore_eos": True},
                ready_timeout,
            )
            speed = SPEED_TOKENS / (time.monotonic() - started)
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    logprobs = answer["choices"][0]["logprobs"]["token_logprobs"][1:]
    return {"perplexity": math.exp(-sum(logprobs) / len(logprobs)), "tokens_per_second": speed}


def served_perplexity(
    checkpoint: Path, ids: list[int], threads: int = 1, ready_timeout: float = 900.0
) -> float:
    """`served_figures`' perplexity, with the default kernels."""
    return served_figures(checkpoint, ids, threads, ready_timeout)["perplexity"]


def _post(base: str, body: dict[str, object], timeout: float) -> dict[str, Any]:
    answer = httpx.post(
        f"{base}/v1/completions", json={"model": NAME, "temperature": 0, **body}, timeout=timeout
    )
    if answer.status_code != 200:
        raise RuntimeError(f"the server answered {answer.status_code}: {answer.text}")
    result: dict[str, Any] = answer.json()
    return result


def _wait_ready(process: subprocess.Popen[bytes], url: str, timeout: float, log: object) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)  # type: ignore[attr-defined]
            tail = log.read()[-3000:].decode(errors="replace")  # type: ignore[attr-defined]
            raise RuntimeError(f"the server exited with {process.returncode}:\n{tail}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not ready in {timeout:.0f} s")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
