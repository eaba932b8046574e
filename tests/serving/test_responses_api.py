"""OpenAI's Responses API through the real server with the real `openai` SDK: create and
stream (raw events and the `responses.stream` helper), a tool round trip, JSON schema output
that parses, the 400s naming their field, both prefixes. The tiny random model writes
gibberish: these check shapes, counts and agreement, not content."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from httpx_sse import connect_sse
from pydantic import BaseModel, Field

from tests.serving.test_grpc_stream import running_requests, wait_idle
from tests.serving.test_openai import LONG, PREFIXES, client
from tests.support import ServerProcess

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
ASK = "What is the weather in Paris?"


class Cat(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=30)


def check_usage(response: Any) -> None:
    usage = response.usage
    assert usage is not None and usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("prefix", PREFIXES)
def test_create_returns_a_message(server: ServerProcess, prefix: str) -> None:
    response = client(server, prefix).responses.create(
        model="tiny", input="Hello", instructions="Be brief.", max_output_tokens=6,
        temperature=0, metadata={"k": "v"}, store=False,
    )  # fmt: skip
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == "tiny" and response.metadata == {"k": "v"}
    assert response.instructions == "Be brief." and response.max_output_tokens == 6
    assert response.status == "incomplete"  # 6 tokens of a random model: the cap ends it
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "incomplete"
    (part,) = message.content
    assert part.type == "output_text" and part.annotations == [] and part.text
    assert response.output_text == part.text
    check_usage(response)
    assert response.usage is not None and response.usage.output_tokens == 6


def test_input_items_equal_the_same_chat(server: ServerProcess) -> None:
    """Items, instructions and roles reach the chat template as chat's messages do."""
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    sdk = client(server)
    response = sdk.responses.create(model="tiny", input=items, max_output_tokens=8, temperature=0)
    chat = sdk.chat.completions.create(
        model="tiny", max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content
    assert chat.usage is not None and response.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("prefix", PREFIXES)
def test_stream_events_agree_with_create(server: ServerProcess, prefix: str) -> None:
    sdk = client(server, prefix)
    kwargs: dict[str, Any] = {
        "model": "tiny", "input": "Tell me a story", "max_output_tokens": 12, "temperature": 0,
    }  # fmt: skip
    unary = sdk.responses.create(**kwargs)
    events = list(sdk.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:5] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
    ]  # fmt: skip
    assert types[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == unary.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.status == unary.status == "incomplete"
    assert final.id == events[0].response.id  # type: ignore[union-attr]
    assert final.usage is not None and unary.usage is not None
    assert final.usage.output_tokens == unary.usage.output_tokens == 12


def test_stream_wire_names_each_event(server: ServerProcess) -> None:
    """Each event is `event: <type>` then `data: <json>` with the same type."""
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[len("data: ") :])["type"] == event[len("event: ") :]


def test_disconnect_frees_the_request(server: ServerProcess) -> None:
    """A client that leaves mid-stream ends its engine request."""
    body = {"model": "tiny", "input": "Go on", "max_output_tokens": LONG, "stream": True}
    with httpx.Client(timeout=60) as http:
        for _ in range(2):
            with connect_sse(http, "POST", f"{server.base_url}/v1/responses", json=body) as source:
                events = source.iter_sse()
                assert next(events).event == "response.created"
                assert running_requests(server) == 1
            # leaving the block closes the connection mid-stream
    wait_idle(server)


def test_stream_helper_parses_the_json_schema(server: ServerProcess) -> None:
    """`responses.stream(text_format=...)`: the helper's final response parses into the model
    (the strict schema is enforced by the grammar); `responses.parse` alike."""
    sdk = client(server)
    with sdk.responses.stream(
        model="tiny", input="Describe a cat.", text_format=Cat, max_output_tokens=60
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed", final.output_text
    assert "".join(deltas) == final.output_text
    cat = final.output_parsed
    assert isinstance(cat, Cat) and 0 <= cat.age <= 30
    parsed = sdk.responses.parse(
        model="tiny", input="Describe a cat.", text_format=Cat, max_output_tokens=60
    )
    assert isinstance(parsed.output_parsed, Cat)


def test_json_object_and_schema_formats(server: ServerProcess) -> None:
    sdk = client(server)
    response = sdk.responses.create(
        model="tiny", input="JSON please", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_object"}},
    )  # fmt: skip
    if response.status == "completed":  # a random model may write a long object
        assert isinstance(json.loads(response.output_text), dict)
    else:
        assert response.output_text.startswith("{")
    schema = Cat.model_json_schema() | {"additionalProperties": False}
    response = sdk.responses.create(
        model="tiny", input="A cat", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "cat", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip(server: ServerProcess, stream: bool) -> None:
    """A forced call parses and validates; its output goes back with the call, and the model
    answers in text."""
    sdk = client(server)
    kwargs: dict[str, Any] = {
        "model": "tiny", "tools": [WEATHER], "max_output_tokens": 80,
        "tool_choice": {"type": "function", "name": "get_weather"},
    }  # fmt: skip
    if stream:
        with sdk.responses.stream(input=ASK, **kwargs) as events:
            arguments = "".join(
                e.delta for e in events if e.type == "response.function_call_arguments.delta"
            )
            first = events.get_final_response()
    else:
        first = sdk.responses.create(input=ASK, **kwargs)
    assert first.status == "completed"
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id is not None and call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    if stream:
        assert arguments == call.arguments
        assert call.parsed_arguments == json.loads(call.arguments)  # type: ignore[attr-defined]
    history: list[Any] = [{"role": "user", "content": ASK}, *first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "18 C"})
    answer = sdk.responses.create(
        model="tiny", input=history, tools=[WEATHER], tool_choice="none", max_output_tokens=8
    )
    assert [item.type for item in answer.output] == ["message"] and answer.output_text


def test_required_calls_stream_as_items(server: ServerProcess) -> None:
    """tool_choice required: only function_call items, each with its arguments' events."""
    events = list(
        client(server).responses.create(
            model="tiny", input=ASK, tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, max_output_tokens=80, stream=True,
        )
    )  # fmt: skip
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == "completed" and final.parallel_tool_calls is False
    assert [item.type for item in final.output] == ["function_call"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [final.output[0].arguments]


def error_of(server: ServerProcess, prefix: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{server.base_url}{prefix}/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error: dict[str, Any] = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True, "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"max_tokens": 5}, "max_tokens"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"reasoning": {"effort": "lots"}}, "reasoning.effort"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0].type"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"oneOf": []}}}},
         "text.format"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice.name"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(
    server: ServerProcess, prefix: str, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 4} | extra
    error = error_of(server, prefix, body)
    assert error["param"] == param, error


def test_sdk_raises_the_400(server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).responses.create(
            model="tiny", input="Hi", previous_response_id="resp_x", store=True
        )
    assert "previous_response_id" in str(caught.value)


def test_unknown_model_is_404(server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError):
        client(server).responses.create(model="nope", input="Hi")
