"""A `python -m predictor` subprocess on loopback ports, for the load scripts."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LocalServer:
    process: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0


def _tail(log_file: Path, lines: int = 40) -> str:
    return "\n".join(log_file.read_text(errors="replace").splitlines()[-lines:])


def wait_ready(process: subprocess.Popen[bytes], url: str, log_file: Path, timeout: float) -> None:
    """Poll `url` until it answers 200; the log's tail if the server exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{_tail(log_file)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not ready in {timeout:.0f} s:\n{_tail(log_file)}")
        time.sleep(0.1)  # a test starts a dozen servers: each waits ~0.05 s past ready, not ~0.25


@contextmanager
def local_server(
    model_dir: str,
    model_name: str,
    log_file: Path,
    extra: Sequence[str] = (),
    ready_timeout: float = 600.0,
    tree: Path = REPO,
) -> Iterator[LocalServer]:
    """Start the server (the checkout `tree`'s predictor), wait until it is ready, stop it with
    SIGTERM at the end."""
    http_port, grpc_port = free_port(), free_port()
    with open(log_file, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "predictor", "--model-dir", model_dir,
             "--model-name", model_name, "--http-port", str(http_port),
             "--grpc-port", str(grpc_port), *extra],
            cwd=tree, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    server = LocalServer(process, http_port, grpc_port)
    try:
        wait_ready(process, f"{server.base_url}/v2/health/ready", log_file, ready_timeout)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(60)
                print(f"server exit code after SIGTERM: {code}")
            except subprocess.TimeoutExpired:
                process.kill()
