"""serving/ports.py and its use at start: a port another process holds is said at once, with exit
2, before the checkpoint loads (the bind used to fail as the start's last step)."""

from __future__ import annotations

import socket
from pathlib import Path

from predictor.serving.ports import taken
from tests.support import run_predictor


def held_port() -> socket.socket:
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


def test_a_held_port_is_named_and_a_free_one_is_not() -> None:
    with held_port() as holder:
        port = holder.getsockname()[1]
        assert taken([("127.0.0.1", port, "REST")]) == [f"REST 127.0.0.1:{port}"]
    assert taken([("127.0.0.1", port, "REST"), ("127.0.0.1", 0, "any")]) == []


def test_a_start_on_a_held_port_stops_before_loading(tiny_gptq_dir: Path) -> None:
    with held_port() as holder:
        port = holder.getsockname()[1]
        code, out = run_predictor(["--model-dir", str(tiny_gptq_dir), "--http-port", str(port),
                                   "--grpc-port", "0"])  # fmt: skip
    assert code == 2 and f"already in use by another process: the REST port 127.0.0.1:{port}" in out
    assert "Loading weights" not in out and "serving tiny" not in out  # said before the load
