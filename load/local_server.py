"""A `python -m predictor` subprocess on loopback ports, for the load scripts."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Process(Protocol):
    """What the server's process is asked: subprocess.Popen's, or a forked one's (the tests')."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


# (the interpreter's arguments: "-m", "predictor", ...; the folder it runs in; its log file)
Launch = Callable[[Sequence[str], Path, Path], Process]


def popen(args: Sequence[str], cwd: Path, log_file: Path) -> subprocess.Popen[bytes]:
    """A new interpreter: `python <args>` in `cwd`, stdout and stderr into `log_file`."""
    with open(log_file, "wb") as log:
        return subprocess.Popen(
            [sys.executable, *args], cwd=cwd, stdout=log, stderr=subprocess.STDOUT
        )


@dataclass
class LocalServer:
    process: Process
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


def wait_ready(process: Process, url: str, log_file: Path, timeout: float) -> None:
    """Poll `url` until it answers 200; the log's tail if the server exits or the time runs out."""
    deadline = time.monotonic() + timeout
    # One client for every poll: a new one per poll (httpx.get) built a TLS context each time,
    # ~20 ms of CPU, taken from the starting server ten times a second.
    with httpx.Client(timeout=2) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{_tail(log_file)}")
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in {timeout:.0f} s:\n{_tail(log_file)}")
            time.sleep(0.1)  # a test starts dozens of servers: each waits ~0.05 s past ready


@contextmanager
def local_server(
    model_dir: str,
    model_name: str,
    log_file: Path,
    extra: Sequence[str] = (),
    ready_timeout: float = 600.0,
    tree: Path = REPO,
    launch: Launch = popen,
) -> Iterator[LocalServer]:
    """Start the server (the checkout `tree`'s predictor), wait until it is ready, stop it with
    SIGTERM at the end."""
    http_port, grpc_port = free_port(), free_port()
    args = ["-m", "predictor", "--model-dir", model_dir, "--model-name", model_name,
            "--http-port", str(http_port), "--grpc-port", str(grpc_port), *extra]  # fmt: skip
    process = launch(args, tree, log_file)
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
