"""Anthropic's Messages API through the real server with the real `anthropic` SDK: create and
stream agree, a tool round trip (tool_use -> tool_result -> answer), stop sequences,
count_tokens, the SSE event sequence, both prefixes, and the errors in Anthropic's shape.
A tiny random model writes gibberish: shapes, counts and consistency are checked, not content."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from tests.serving.test_fuzz import post_non_finite
from tests.serving.test_overload import full_queue
from tests.support import ServerProcess

# the SDK adds /v1/messages: the bare prefix is the host, KServe's is the host and /openai
BASES = ("", "/openai")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA},
    {"name": "get_time", "input_schema": {"type": "object", "properties": {}}},
]
# anthropic 2.10's create() has no sampling arguments (the API's newest models take none);
# the server takes temperature, top_p and top_k as Anthropic's API long did
GREEDY = {"temperature": 0}
HEADERS = {"x-api-key": "unused", "anthropic-version": "2023-06-01"}


def client(server: ServerProcess, base: str = "") -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.base_url + base, api_key="unused", max_retries=0, timeout=120
    )


def check_usage(usage: Any, max_tokens: int) -> None:
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) > 0
    assert 0 < usage.output_tokens <= max_tokens
    assert usage.cache_creation_input_tokens == 0


@pytest.mark.parametrize("base", BASES)
def test_create_and_stream_give_one_answer(server: ServerProcess, base: str) -> None:
    kwargs: dict[str, Any] = dict(
        model="tiny", max_tokens=8, system="Answer briefly.", messages=ASK, extra_body=GREEDY
    )
    out = client(server, base).messages.create(**kwargs)
    assert out.id.startswith("msg_") and out.type == "message" and out.role == "assistant"
    assert out.model == "tiny" and out.stop_reason in ("max_tokens", "end_turn")
    assert out.stop_sequence is None
    check_usage(out.usage, 8)
    if out.stop_reason == "max_tokens":
        assert out.usage.output_tokens == 8
    assert all(b.type == "text" for b in out.content) and len(out.content) <= 1
    text = "".join(b.text for b in out.content if b.type == "text")
    with client(server, base).messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert [b.model_dump(include={"type", "text"}) for b in final.content] == [
        b.model_dump(include={"type", "text"}) for b in out.content
    ]
    assert final.stop_reason == out.stop_reason
    assert final.usage.output_tokens == out.usage.output_tokens
    total = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert total == out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0)
    # the same conversation through chat completions: the same prompt, the same greedy text
    chat = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    answer = chat.chat.completions.create(
        model="tiny", max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."}, *ASK],
    )  # fmt: skip
    assert answer.choices[0].message.content == text
    assert answer.usage is not None and answer.usage.prompt_tokens == total


def test_count_tokens_is_the_prompt_a_message_reads(server: ServerProcess) -> None:
    sdk = client(server)
    for base in BASES:
        counted = client(server, base).messages.count_tokens(model="tiny", messages=ASK)
        assert counted.input_tokens > 0
    out = sdk.messages.create(model="tiny", max_tokens=2, messages=ASK)
    assert out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0) == (
        counted.input_tokens
    )
    with_tools = sdk.messages.count_tokens(model="tiny", messages=ASK, tools=TOOLS)
    assert with_tools.input_tokens > counted.input_tokens + 50  # the tools' text
    called = sdk.messages.create(
        model="tiny", max_tokens=100, messages=ASK, tools=TOOLS, tool_choice={"type": "any"}
    )
    assert called.usage.input_tokens + (called.usage.cache_read_input_tokens or 0) == (
        with_tools.input_tokens
    )


def test_the_stream_sends_anthropics_event_sequence(server: ServerProcess) -> None:
    body = {"model": "tiny", "max_tokens": 6, "messages": ASK, "stream": True}
    headers = {**HEADERS, "anthropic-beta": "prompt-caching-2024-07-31"}
    names: list[str] = []
    with httpx.stream(
        "POST", f"{server.base_url}/v1/messages", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name
                names.append(data["type"])
                if name == "message_start":
                    assert data["message"]["content"] == [] and data["message"]["usage"]
                if name == "message_delta":
                    assert data["delta"]["stop_reason"] == "max_tokens"
                    assert data["usage"]["output_tokens"] == 6
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def tool_uses(message: Any) -> list[Any]:
    calls = [b for b in message.content if b.type == "tool_use"]
    for call in calls:
        assert call.id.startswith("toolu_")
        if call.name == "get_weather":
            jsonschema.validate(call.input, WEATHER_SCHEMA)
    return calls


def test_a_tool_round_trip(server: ServerProcess) -> None:
    sdk = client(server)
    forced = {"type": "tool", "name": "get_weather"}
    out = sdk.messages.create(
        model="tiny",
        max_tokens=150,
        messages=ASK,
        tools=TOOLS,
        tool_choice=forced,
        extra_body=GREEDY,
    )
    assert out.stop_reason == "tool_use", out
    (call,) = tool_uses(out)
    assert call.name == "get_weather"
    with sdk.messages.stream(
        model="tiny",
        max_tokens=150,
        messages=ASK,
        tools=TOOLS,
        tool_choice=forced,
        extra_body=GREEDY,
    ) as stream:
        final = stream.get_final_message()
    (streamed,) = tool_uses(final)
    assert (streamed.name, streamed.input) == (call.name, call.input)
    assert final.stop_reason == "tool_use"
    history = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in out.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees and sunny"},
            {"type": "text", "text": "So?"},
        ]},
    ]  # fmt: skip
    answer = sdk.messages.create(
        model="tiny", max_tokens=10, messages=history, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]
    # an error result and content blocks are taken too
    history[-1]["content"] = [  # type: ignore[index]
        {"type": "tool_result", "tool_use_id": call.id, "is_error": True,
         "content": [{"type": "text", "text": "no such city"}]},
    ]  # fmt: skip
    again = sdk.messages.create(model="tiny", max_tokens=4, messages=history, tools=TOOLS)
    assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_any_calls_and_disable_parallel_tool_use_allows_one(server: ServerProcess) -> None:
    for seed_text in ("Paris?", "Rome?", "Oslo?"):
        out = client(server).messages.create(
            model="tiny", max_tokens=200, extra_body={"temperature": 0.8}, tools=TOOLS,
            messages=[{"role": "user", "content": seed_text}],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
        )  # fmt: skip
        assert out.stop_reason == "tool_use" and len(tool_uses(out)) == 1


def test_a_stop_sequence_ends_the_text_and_is_named(server: ServerProcess) -> None:
    sdk = client(server)
    kwargs: dict[str, Any] = dict(model="tiny", max_tokens=16, messages=ASK, extra_body=GREEDY)
    text = sdk.messages.create(**kwargs).content[0].text  # type: ignore[union-attr]
    stop = text[4:7]
    assert len(stop) == 3, text
    out = sdk.messages.create(**kwargs, stop_sequences=["never seen \x01", stop])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert "".join(b.text for b in out.content if b.type == "text") == text[: text.find(stop)]
    with sdk.messages.stream(**kwargs, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_structured_output_validates_whole_and_streamed(server: ServerProcess) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "blue"]}, "n": {"type": "integer"}},
        "required": ["colour", "n"],
        "additionalProperties": False,
    }
    kwargs: dict[str, Any] = dict(
        model="tiny", max_tokens=60, messages=ASK, extra_body={"temperature": 0.8},
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )  # fmt: skip
    out = client(server).messages.create(**kwargs)
    with client(server).messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    for message in (out, final):
        (block,) = message.content
        assert block.type == "text" and block.text.startswith("{")
        if message.stop_reason == "end_turn":  # else cut by max_tokens: a prefix of one
            jsonschema.validate(json.loads(block.text), schema)


def post(server: ServerProcess, body: Any, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=HEADERS, timeout=60)


BASE_BODY: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "messages": ASK}


@pytest.mark.parametrize(
    ("body", "status", "kind", "named"),
    [
        ({"model": "tiny", "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
        ({**BASE_BODY, "frequency_penalty": 1}, 400, "invalid_request_error", "frequency_penalty"),
        ({**BASE_BODY, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         400, "invalid_request_error", "web_search_20250305"),
        ({**BASE_BODY, "thinking": {"type": "sometimes"}},
         400, "invalid_request_error", "thinking.type"),
        ({**BASE_BODY, "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
        ({**BASE_BODY, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
         400, "invalid_request_error", "image"),
        ({**BASE_BODY, "messages": [*ASK, {"role": "assistant", "content": "Well,"}]},
         400, "invalid_request_error", "messages[1]"),
        ({**BASE_BODY, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
         400, "invalid_request_error", "nope"),
        ({**BASE_BODY, "output_config": {"format": {"type": "json_schema", "schema": {
            "type": "object", "properties": {"m": {"type": "string", "format": "email"}}}}}},
         400, "invalid_request_error", "output_config.format"),
        ({**BASE_BODY, "model": "nope"}, 404, "not_found_error", "nope"),
    ],
)  # fmt: skip
def test_errors_are_in_anthropics_shape(
    server: ServerProcess, body: dict[str, Any], status: int, kind: str, named: str
) -> None:
    for path in ("/v1/messages", "/openai/v1/messages"):
        r = post(server, {**body, "stream": True}, path)
        assert r.status_code == status, r.text
        error = r.json()
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
        assert error["error"]["type"] == kind and named in error["error"]["message"], error


def test_the_sdk_raises_its_own_errors(server: ServerProcess) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client(server).messages.create(model="nope", max_tokens=4, messages=ASK)
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "Model with name nope does not exist."},
    }
    with pytest.raises(anthropic.BadRequestError) as refused:
        client(server).messages.count_tokens(
            model="tiny", messages=ASK, thinking={"type": "enabled", "budget_tokens": -1}
        )
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["error"]["type"] == "invalid_request_error"


def test_a_full_queue_is_429_rate_limit_error(small: ServerProcess) -> None:
    """The holders of full_queue send their next request as one ends: a request may land in
    that gap and be served, so each kind is sent until the queue is found full."""
    with full_queue(small):
        for stream in (False, True):
            replies = [post(small, {**BASE_BODY, "stream": stream}) for _ in range(5)]
            r = next(r for r in replies if r.status_code != 200)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
        sdk = client(small, "/openai")
        with pytest.raises(anthropic.RateLimitError):
            for _ in range(5):
                sdk.messages.create(model="tiny", max_tokens=2, messages=ASK)


def test_what_the_edge_refuses_is_in_anthropics_shape_too(server: ServerProcess) -> None:
    """The body guard (non-finite numbers) and malformed JSON, on the Messages routes."""
    for raw in (b'{"model": "tiny", "max_tokens": 4, "temperature": NaN}', b"{not json"):
        r = httpx.post(
            f"{server.base_url}/v1/messages/count_tokens", content=raw,
            headers={**HEADERS, "content-type": "application/json"}, timeout=60,
        )  # fmt: skip
        assert r.status_code == 400
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_thinking_disabled_metadata_and_cache_control_are_accepted(server: ServerProcess) -> None:
    out = client(server).messages.create(
        model="tiny", max_tokens=3, thinking={"type": "disabled"},
        metadata={"user_id": "team-a"}, extra_body={"top_k": 5, "top_p": 0.9},
        cache_control={"type": "ephemeral"}, service_tier="auto",
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Hello", "cache_control": {"type": "ephemeral"}}]}],
    )  # fmt: skip
    assert out.stop_reason in ("max_tokens", "end_turn")


def test_the_messages_routes_never_answer_5xx(server: ServerProcess) -> None:
    """schemathesis on the served OpenAPI document's Messages routes (as test_openai_fuzz.py);
    each body also sent with a non-finite number: a 400 in Anthropic's shape."""
    routes = r"^/(openai/)?v1/messages(/count_tokens)?$"
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json").include(
        path_regex=routes
    )
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} == {
        f"{prefix}/messages{tail}"
        for prefix in ("/v1", "/openai/v1")
        for tail in ("", "/count_tokens")
    }
    with httpx.Client(timeout=60) as http:
        for operation in operations:

            @given(case=operation.as_strategy(), data=st.data())
            @settings(
                max_examples=15,
                deadline=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            def check(case: schemathesis.Case, data: st.DataObject) -> None:
                if isinstance(case.body, dict):
                    case.body["model"] = "tiny"  # reach the body checks, not 404s
                    case.body["max_tokens"] = min(case.body.get("max_tokens") or 4, 4)
                response = case.call(timeout=60)
                case.validate_response(response, checks=[not_a_server_error])
                post_non_finite(http, case, data, openai=True)  # Anthropic's has the same keys

            check()
