"""Hostile and unlucky input through the real server: constraints no text satisfies or that
cannot be enforced are a 400 naming the field on every protocol, streamed or not (never a 500
blaming the model); slow grammar compiles are bounded (400 too complex, 429 past the cap) and
leave plain requests their latency; the small ones (developer role, /tokenize without a model,
probes logged at DEBUG)."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.serving.test_grpc_stream import call_stream, stream_request
from tests.serving.test_openai import client
from tests.support import ServerProcess

FORMS = {  # structured_outputs (vLLM's key, taken on every protocol) no text can satisfy
    "regex matching nothing": {"regex": r"[^\s\S]"},
    "ebnf with an empty language": {"grammar": 'root ::= "a" root'},
    "empty anyOf": {"json": {"anyOf": []}},
    "empty type list": {"json": {"type": []}},
    "ref to another document": {"json": {"$ref": "https://example.com/schema.json"}},
}
SLOW = (
    "[^x]{{0,{}}}y"  # ~1.5 s for xgrammar to compile on 2 cores (tests/engine/test_grammar_limits)
)


def v2_infer(form: dict[str, Any]) -> dict[str, Any]:
    return {
        "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
        "parameters": {"max_tokens": 8, "structured_outputs": json.dumps(form)},
    }


@pytest.mark.parametrize("name", sorted(FORMS))
def test_no_text_satisfies_it_is_a_400_on_every_protocol(server: ServerProcess, name: str) -> None:
    form = FORMS[name]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client(server).chat.completions.create(
                **chat, stream=stream, extra_body={"structured_outputs": form}
            )
        assert caught.value.body["param"] == "structured_outputs", caught.value.body  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).completions.create(
            model="tiny", prompt="x", max_tokens=8, extra_body={"structured_outputs": form}
        )
    base = f"{server.base_url}/v2/models/tiny"
    oip = {"text_input": "x", "parameters": {"max_tokens": 8, "structured_outputs": form}}
    for route, body in (("generate", oip), ("generate_stream", oip), ("infer", v2_infer(form))):
        reply = httpx.post(f"{base}/{route}", json=body, timeout=60)
        assert reply.status_code == 400, (route, reply.text)
        assert "structured_outputs" in reply.json()["error"]
    request = stream_request("g", b"x", 8, empty_final=True)
    request.parameters["structured_outputs"].string_param = json.dumps(form)
    (response,) = call_stream(server, [request])
    assert "structured_outputs" in response.error_message


def test_a_dead_end_met_while_decoding_is_a_400_not_a_model_fault(server: ServerProcess) -> None:
    """The first token is allowed ('a'), the second is not: the request still fails as the
    client's, naming the field."""
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=8,
            extra_body={"structured_outputs": {"regex": r"a[^\s\S]"}},
        )  # fmt: skip
    assert caught.value.body["param"] == "structured_outputs"  # type: ignore[index]
    assert "non-finite" not in str(caught.value.body)


def test_a_schema_sent_as_text_is_held_to_the_depth_limit(server: ServerProcess) -> None:
    deep = '{"type": "array", "items": ' * 40 + '{"type": "string"}' + "}" * 40
    body = {"text_input": "x", "parameters": {"structured_outputs": {"json": deep}}}
    reply = httpx.post(f"{server.base_url}/v2/models/tiny/generate", json=body, timeout=60)
    assert reply.status_code == 400 and "nested deeper" in reply.json()["error"]


def test_the_developer_role_is_a_system_turn(server: ServerProcess) -> None:
    out = client(server).chat.completions.create(
        model="tiny", max_tokens=3,
        messages=[{"role": "developer", "content": "Answer briefly."},
                  {"role": "user", "content": "hi"}],
    )  # fmt: skip
    assert out.usage is not None and out.usage.completion_tokens == 3


def test_tokenize_without_a_model_takes_the_one_served(server: ServerProcess) -> None:
    for route, body in (("tokenize", {"prompt": "Hello"}), ("detokenize", {"tokens": [1, 2]})):
        reply = httpx.post(f"{server.base_url}/{route}", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
    reply = httpx.post(f"{server.base_url}/tokenize", json={"model": "nope", "prompt": "x"})
    assert reply.status_code == 404


def test_probes_and_scrapes_log_at_debug(server: ServerProcess) -> None:
    before = len(server.log().splitlines())
    for path in ("/v2/health/ready", "/v2/health/live", "/v2/models/tiny/ready", "/metrics"):
        assert httpx.get(server.base_url + path, timeout=10).status_code == 200
    httpx.get(server.base_url + "/v2/models/tiny", timeout=10)  # not a probe: logged
    time.sleep(0.3)
    lines = server.log().splitlines()[before:]
    assert not [line for line in lines if "health" in line or "/metrics" in line or "ready" in line]
    assert any("/v2/models/tiny" in line for line in lines)


@pytest.fixture(scope="module")
def strict(tiny_gptq_dir: Path) -> Iterator[ServerProcess]:
    """A server that waits half a second for a grammar and compiles two at once at most."""
    extra = ["--grammar-compile-timeout", "0.5", "--max-grammar-compiles", "2"]
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as proc:
        yield proc


def post_regex(server: ServerProcess, regex: str) -> httpx.Response:
    body = {"text_input": "x", "parameters": {"max_tokens": 4,
            "structured_outputs": {"regex": regex}}}  # fmt: skip
    return httpx.post(f"{server.base_url}/v2/models/tiny/generate", json=body, timeout=60)


def test_slow_compiles_are_too_complex_past_the_cap_429_and_abandoned_free_their_slot(
    strict: ServerProcess,
) -> None:
    replies: dict[int, httpx.Response] = {}

    def send(i: int) -> None:
        replies[i] = post_regex(strict, SLOW.format(2000 + i))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # in order: the third finds both slots taken
    for thread in threads:
        thread.join()
    codes = sorted(r.status_code for r in replies.values())
    assert codes == [400, 400, 429], {i: r.text for i, r in replies.items()}
    refused = next(r for r in replies.values() if r.status_code == 429)
    assert refused.headers.get("Retry-After")
    assert all("too complex" in r.json()["error"] for r in replies.values() if r.status_code == 400)
    # both waiters left at 0.5 s with a 400, their compiles still running (xgrammar's cannot be
    # stopped; the pool started the second within a quantum of the first): a new slow one finds
    # both places taken, which is the server's business (429, Retry-After), never a 400
    busy = post_regex(strict, SLOW.format(3000))
    assert busy.status_code == 429 and busy.headers.get("Retry-After"), busy.text
    plain = httpx.post(f"{strict.base_url}/v2/models/tiny/generate",
                       json={"text_input": "x", "parameters": {"max_tokens": 4}}, timeout=60)  # fmt: skip
    assert plain.status_code == 200


def latency(server: ServerProcess) -> float:
    started = time.perf_counter()
    reply = httpx.post(f"{server.base_url}/v2/models/tiny/generate",
                       json={"text_input": "Hello", "parameters": {"max_tokens": 4}}, timeout=60)  # fmt: skip
    assert reply.status_code == 200
    return time.perf_counter() - started


@pytest.mark.serial
def test_plain_requests_keep_their_latency_while_8_slow_grammars_compile(
    server: ServerProcess,
) -> None:
    idle = statistics.median(latency(server) for _ in range(7))
    replies: list[int] = []
    threads = [
        threading.Thread(target=lambda i=i: replies.append(post_regex(server, SLOW.format(4000 + i)).status_code))
        for i in range(8)
    ]  # fmt: skip
    for thread in threads:
        thread.start()
    time.sleep(0.3)  # all eight in flight: one compiling, seven waiting for the thread
    loaded = statistics.median(latency(server) for _ in range(5))
    for thread in threads:
        thread.join()
    # compiled one after another: the first within the default 10 s budget, the last past it
    assert 200 in replies and set(replies) <= {200, 400}, replies
    assert loaded <= max(2 * idle, idle + 0.05), (idle, loaded)
