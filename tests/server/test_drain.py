"""SIGTERM on a real server process: readiness false at once, new requests 503, streams in flight
finish within the grace period, then exit 0."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import httpx

from tests.support import ServerProcess

LONG = {"text_input": "Go on", "parameters": {"max_tokens": 500}}


def read_stream(base: str, out: list[dict], started: threading.Event) -> None:
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{base}/v2/models/tiny/generate_stream", json=LONG) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                started.set()


def test_sigterm_drains_then_exits_zero(tiny_gptq_dir: Path) -> None:
    with ServerProcess.start(
        tiny_gptq_dir, "tiny", extra=["--drain-seconds", "30", "--max-tokens-limit", "512"]
    ) as srv:
        events: list[dict] = []
        started = threading.Event()
        reader = threading.Thread(target=read_stream, args=(srv.base_url, events, started))
        reader.start()
        assert started.wait(30)
        srv.process.send_signal(signal.SIGTERM)
        ready = httpx.get(f"{srv.base_url}/v2/health/ready", timeout=5)
        assert ready.status_code == 503
        refused = httpx.post(
            f"{srv.base_url}/v2/models/tiny/generate", json={"text_input": "x"}, timeout=5
        )
        assert refused.status_code == 503 and refused.json()["error"]
        infer = {
            "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["x"]}]
        }
        assert (
            httpx.post(f"{srv.base_url}/v2/models/tiny/infer", json=infer, timeout=5).status_code
            == 503
        )
        reader.join(60)
        assert srv.process.wait(30) == 0
    assert events[-1]["finish_reason"] == "length"
    assert events[-1]["details"]["generated_tokens"] == 500


def test_grace_period_ends_leftover_streams_with_an_error_event(tiny_gptq_dir: Path) -> None:
    with ServerProcess.start(
        tiny_gptq_dir, "tiny", extra=["--drain-seconds", "0", "--max-tokens-limit", "512"]
    ) as srv:
        events: list[dict] = []
        started = threading.Event()
        reader = threading.Thread(target=read_stream, args=(srv.base_url, events, started))
        reader.start()
        assert started.wait(30)
        srv.process.send_signal(signal.SIGTERM)
        reader.join(60)
        assert srv.process.wait(30) == 0
    assert "error" in events[-1] and "stopped" in events[-1]["error"]
