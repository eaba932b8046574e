"""SIGTERM on a real server process: readiness false at once, new requests 503, streams in flight
finish within the grace period, then exit 0."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support import ServerProcess

# without drafts: a random model repeats itself, and at 9 tokens a step its stream could end
# (and the drained server exit) before the checks below are sent; these need one step a token
LONG = {"text_input": "Go on",
        "parameters": {"max_tokens": 500, "ignore_eos": True, "speculative": False}}  # fmt: skip


def read_stream(base: str, out: list[dict], started: threading.Event) -> None:
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{base}/v2/models/tiny/generate_stream", json=LONG) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                started.set()


@contextmanager
def stream_then_sigterm(
    model_dir: Path, drain_seconds: int, flag: str = "--drain-seconds"
) -> Iterator[tuple[ServerProcess, list[dict]]]:
    """A server with one long stream under way, sent SIGTERM; it must exit 0 by the block's end."""
    extra = [flag, str(drain_seconds), "--max-tokens-limit", "512"]
    with ServerProcess.start(model_dir, "tiny", extra=extra) as srv:
        events: list[dict] = []
        started = threading.Event()
        reader = threading.Thread(target=read_stream, args=(srv.base_url, events, started))
        reader.start()
        assert started.wait(30)
        srv.process.send_signal(signal.SIGTERM)
        yield srv, events
        reader.join(60)
        assert srv.process.wait(30) == 0


def test_sigterm_drains_then_exits_zero(tiny_gptq_dir: Path) -> None:
    with stream_then_sigterm(tiny_gptq_dir, drain_seconds=30) as (srv, events):
        ready = httpx.get(f"{srv.base_url}/v2/health/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["error"]
        model_ready = httpx.get(f"{srv.base_url}/v2/models/tiny/ready", timeout=5)
        assert model_ready.status_code == 503 and model_ready.json()["error"]
        health = httpx.get(f"{srv.base_url}/health", timeout=5)  # vLLM's probe, as llm-d reads it
        assert health.status_code == 503 and health.json()["error"]
        assert "Traceback" not in srv.log()  # a state, not a fault: no traceback per probe
        refused = httpx.post(
            f"{srv.base_url}/v2/models/tiny/generate", json={"text_input": "x"}, timeout=5
        )
        assert refused.status_code == 503 and refused.json()["error"]
        tensor = {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["x"]}
        infer = httpx.post(f"{srv.base_url}/v2/models/tiny/infer", json={"inputs": [tensor]})
        assert infer.status_code == 503
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        openai = httpx.post(f"{srv.base_url}/v1/chat/completions", json=chat, timeout=5)
        assert openai.status_code == 503  # in OpenAI's error shape
        assert set(openai.json()["error"]) == {"message", "type", "param", "code"}
        messages = httpx.post(f"{srv.base_url}/v1/messages", json=chat, timeout=5)
        assert messages.status_code == 503  # in Anthropic's error shape
        assert messages.json()["error"]["type"] == "overloaded_error"
    assert events[-1]["finish_reason"] == "length"
    assert events[-1]["details"]["generated_tokens"] == 500


# ours, and vLLM's name, which KServe's LLMInferenceService passes (40 s: its pod's grace period
# less the preStop pause and 5 s)
@pytest.mark.parametrize("flag", ["--drain-seconds", "--shutdown-timeout"])
def test_grace_period_ends_leftover_streams_with_an_error_event(
    tiny_gptq_dir: Path, flag: str
) -> None:
    with stream_then_sigterm(tiny_gptq_dir, drain_seconds=0, flag=flag) as (_, events):
        pass
    assert "error" in events[-1] and "stopped" in events[-1]["error"]
