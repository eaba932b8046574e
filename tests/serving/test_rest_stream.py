"""generate, generate_stream and infer_stream over real HTTP: httpx, httpx-sse, curl."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import AsyncIterator

import httpx
import pytest
from httpx_sse import connect_sse

from predictor.serving.rest.oip import stream_sse
from predictor.types import FinishReason, TokenEvent, Usage
from tests.serving.test_grpc_stream import running_requests, wait_idle
from tests.support import ServerProcess

# long enough that the tiny model is still generating when the first event arrives
LONG = 500


def url(server: ServerProcess, route: str, model: str = "tiny") -> str:
    return f"{server.base_url}/v2/models/{model}/{route}"


def test_generate(server: ServerProcess) -> None:
    body = {"id": "42", "text_input": "Hello", "parameters": {"max_tokens": 5, "details": True}}
    r = httpx.post(url(server, "generate"), json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "42" and out["model_name"] == "tiny" and isinstance(out["text_output"], str)
    assert out["details"]["finish_reason"] == "length"
    assert out["details"]["generated_tokens"] == 5 and out["details"]["prompt_tokens"] >= 1


def test_generate_stream_events_and_headers(server: ServerProcess) -> None:
    body = {"id": "s1", "text_input": "Tell me", "parameters": {"max_tokens": LONG, "chat": True}}
    with (
        httpx.Client(timeout=60) as client,
        connect_sse(client, "POST", url(server, "generate_stream"), json=body) as source,
    ):
        response = source.response
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        events = []
        for sse in source.iter_sse():
            if not events:  # the first event leaves while the request is still generating
                assert running_requests(server) == 1
            events.append(json.loads(sse.data))
    assert len(events) >= 2
    assert all(e["id"] == "s1" and "text_output" in e for e in events)
    assert all("finish_reason" not in e for e in events[:-1])
    last = events[-1]
    assert last["finish_reason"] in ("length", "eos_token")
    assert last["details"]["generated_tokens"] >= len(events) - 1
    full = httpx.post(url(server, "generate"), json=body, timeout=60).json()["text_output"]
    assert "".join(e["text_output"] for e in events) == full  # greedy: same text either way


def test_versioned_routes(server: ServerProcess) -> None:
    body = {"text_input": "Hi", "parameters": {"max_tokens": 2}}
    r = httpx.post(f"{server.base_url}/v2/models/tiny/versions/1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("route", "model", "content", "status"),
    [
        ("generate_stream", "nope", '{"text_input": "x"}', 404),
        ("generate_stream", "tiny", "{not json", 400),
        ("generate_stream", "tiny", '{"text_input": "x", "parameters": {"max_tokens": 0}}', 400),
        ("generate_stream", "tiny", '{"text_input": 5}', 400),
        ("generate", "tiny", '{"text_input": "x", "parameters": {"top_p": 2}}', 400),
        ("infer_stream", "tiny", '{"inputs": [{"name": "text_input"}]}', 400),
        ("infer_stream", "nope", '{"inputs": []}', 404),
    ],
)
def test_errors_before_the_first_byte_are_json(
    server: ServerProcess, route: str, model: str, content: str, status: int
) -> None:
    r = httpx.post(
        url(server, route, model),
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]


async def test_error_after_the_first_byte_is_an_event() -> None:
    async def events() -> AsyncIterator[TokenEvent]:
        yield TokenEvent("e", "Hello", (1,))
        yield TokenEvent(
            "e", "", (), FinishReason.ERROR, Usage(1, 1), "the model produced non-finite logits"
        )

    response = await stream_sse(events(), lambda e: {"text_output": e.text})  # type: ignore[arg-type]
    chunks = [chunk async for chunk in response.body_iterator]  # type: ignore[attr-defined]
    assert chunks == [
        b'data: {"text_output": "Hello"}\n\n',
        b'data: {"error": "the model produced non-finite logits"}\n\n',
    ]


def test_infer_stream(server: ServerProcess) -> None:
    body = {
        "id": "v",
        "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Hi"]}],
        "parameters": {"max_tokens": 4},
    }
    with (
        httpx.Client(timeout=60) as client,
        connect_sse(client, "POST", url(server, "infer_stream"), json=body) as source,
    ):
        events = [json.loads(e.data) for e in source.iter_sse()]
    assert all(e["id"] == "v" and e["outputs"][0]["name"] == "text_output" for e in events)
    assert events[-1]["parameters"]["generated_tokens"] == 4


def test_gzip_compresses_unary_but_never_streams(server: ServerProcess) -> None:
    body = {
        "inputs": [
            {"name": "text_input", "shape": [8], "datatype": "BYTES", "data": ["Hello"] * 8}
        ],
        "parameters": {"max_tokens": 32},
    }
    r = httpx.post(url(server, "infer"), json=body, headers={"accept-encoding": "gzip"}, timeout=60)
    assert r.status_code == 200 and r.headers.get("content-encoding") == "gzip"
    stream_body = {"text_input": "Go", "parameters": {"max_tokens": LONG}}
    with (
        httpx.Client(timeout=60, headers={"accept-encoding": "gzip"}) as client,
        client.stream("POST", url(server, "generate_stream"), json=stream_body) as response,
    ):
        assert "content-encoding" not in response.headers
        chunks = response.iter_text()  # keep a reference: dropping it closes the connection
        first = next(chunks)
        assert first.startswith("data: ") and running_requests(server) == 1  # one by one
        rest = "".join(chunks)
    assert (first + rest).count("data: ") >= 2


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_sees_events(server: ServerProcess) -> None:
    done = subprocess.run(
        ["curl", "-sN", url(server, "generate_stream"), "-d", '{"text_input": "Hi", "parameters": {"max_tokens": 6}}'],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    events = [
        json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("data: ")
    ]
    assert len(events) >= 2 and events[-1]["finish_reason"] == "length"


def test_client_disconnect_aborts_the_request(server: ServerProcess) -> None:
    body = {"text_input": "Go on", "parameters": {"max_tokens": LONG}}
    with httpx.Client(timeout=60) as client:
        for _ in range(3):
            with client.stream("POST", url(server, "generate_stream"), json=body) as response:
                lines = response.iter_lines()
                next(lines)
                assert running_requests(server) >= 1
            # leaving the block closes the connection mid-stream
    wait_idle(server)
