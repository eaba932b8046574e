"""PayloadLog against a CloudEvents sink that is down, then up: records are dropped and counted
without a connection attempt each while it is down, the outage is logged once, and records flow
again once it answers."""

from __future__ import annotations

import http.server
import logging
import socket
import threading
import time
from typing import Any

import pytest

from predictor.observability.payloads import PayloadLog


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def record(i: int) -> dict[str, Any]:
    return {"id": f"r{i}", "prompt": "p", "response": "r"}


class Sink(http.server.BaseHTTPRequestHandler):
    got: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        Sink.got.append(self.rfile.read(int(self.headers["content-length"])))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_a_sink_that_is_down_costs_one_try_and_one_warning_then_records_flow_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    dropped: list[int] = []
    payloads = PayloadLog(f"http://127.0.0.1:{port}/", "hash", "test", dropped.append)
    caplog.set_level(logging.INFO, logger="predictor.observability.payloads")
    for i in range(30):
        payloads.submit(record(i))
    assert payloads.flush(10)
    assert sum(dropped) == 30
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1  # not one a record
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        time.sleep(1.2)  # past the first retry
        for i in range(30, 33):
            payloads.submit(record(i))
        assert payloads.flush(10)
    finally:
        server.shutdown()
        payloads.shutdown()
    assert len(Sink.got) == 3 and sum(dropped) == 30
    assert any("answers again" in r.getMessage() for r in caplog.records)
