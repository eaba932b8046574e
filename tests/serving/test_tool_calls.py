"""Tool calling through the real server with the `openai` SDK: forced calls (required, a named
tool, one or many) always parse and validate, unary and streamed; `auto` and `none`; tool turns
in the history; the 400s."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.serving.test_openai import client
from tests.support import ServerProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CONVERT = {
    "type": "function",
    "function": {
        "name": "convert",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "minimum": 0, "maximum": 1000},
                "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
            },
            "required": ["amount", "to"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CONVERT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls: Any) -> list[str]:
    """Every call names a tool and its arguments validate; the names, in order."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)
    return [c.function.name for c in calls]


def test_required_calls_always_parse_and_validate(server: ServerProcess) -> None:
    out = client(server).chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", n=4, seed=1,
        temperature=0.8, max_tokens=300, parallel_tool_calls=False,
    )  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        check_calls(choice.message.tool_calls)
        assert choice.message.content is None


def test_parallel_calls_all_validate(server: ServerProcess) -> None:
    """A random model rarely ends a run of parallel calls: every call but a cut-off last one
    validates, and the text holds more than one."""
    out = client(server).chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", n=2, seed=2,
        temperature=0.8, max_tokens=200,
    )  # fmt: skip
    for choice in out.choices:
        calls = choice.message.tool_calls or []
        assert len(calls) > 1
        if choice.finish_reason == "length":
            calls = calls[:-1]
        else:
            assert choice.finish_reason == "tool_calls"
        check_calls(calls)


def test_a_named_tool_is_called_once_and_parallel_false_allows_one(server: ServerProcess) -> None:
    named = {"type": "function", "function": {"name": "convert"}}
    for seed in range(3):
        out = client(server).chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice=named, seed=seed,
            temperature=0.8, max_tokens=200,
        )  # fmt: skip
        assert check_calls(out.choices[0].message.tool_calls) == ["convert"]
        out = client(server).chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,
            temperature=0.8, max_tokens=200, parallel_tool_calls=False,
        )  # fmt: skip
        assert len(check_calls(out.choices[0].message.tool_calls)) == 1


def test_streamed_calls_arrive_as_openai_sends_them(server: ServerProcess) -> None:
    kwargs: dict[str, Any] = dict(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", seed=7,
        temperature=0.8, max_tokens=300,
    )  # fmt: skip
    whole = client(server).chat.completions.create(**kwargs)
    chunks = list(client(server).chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    calls: dict[int, dict[str, str]] = {}
    for c in chunks:
        for piece in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            if piece.id is not None:  # a call's first delta: its id, type and name
                assert piece.index not in calls and piece.type == "function"
                assert piece.function is not None and piece.function.name
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "args": ""}
            assert piece.function is not None
            calls[piece.index]["args"] += piece.function.arguments or ""
    # parallel calls from a random model may run to the token cap: the last one is cut off
    finish = whole.choices[0].finish_reason
    assert finish in ("tool_calls", "length") and chunks[-1].choices[0].finish_reason == finish
    expected = whole.choices[0].message.tool_calls
    assert expected is not None
    assert [(c["name"], c["args"]) for c in calls.values()] == [
        (e.function.name, e.function.arguments) for e in expected
    ]
    check_calls(expected[:-1] if finish == "length" else expected)


def test_auto_and_none_answer_in_text_when_no_call_is_made(server: ServerProcess) -> None:
    for choice in ("auto", "none"):
        out = client(server).chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=12,
            # "<" cannot be sampled, so no call begins: the text is the answer ("\n" neither:
            # the random model writes blank lines)
            logit_bias={"44": -100, "198": -100, "1116": -100},
        )  # fmt: skip
        message = out.choices[0].message
        assert message.tool_calls is None and message.content
        assert out.choices[0].finish_reason in ("stop", "length")


def test_tool_turns_in_the_history_reach_the_prompt(server: ServerProcess) -> None:
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]  # fmt: skip
    tokens = httpx.post(
        f"{server.base_url}/tokenize",
        json={"model": "tiny", "messages": history, "return_token_strs": False}, timeout=30,
    ).json()  # fmt: skip
    text = httpx.post(
        f"{server.base_url}/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]},
        timeout=30,
    ).json()["prompt"]  # fmt: skip
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in text
    out = client(server).chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=8
    )
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with_tools = client(server).chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200
    )
    assert with_tools.usage is not None and out.usage is not None
    plain = client(server).chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
    assert plain.usage is not None
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the tools' text


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"m": {"type": "string", "format": "email"}}}}}]},
         "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
         "tools[0].function.name"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_it(
    server: ServerProcess, change: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(model="tiny", messages=ASK, max_tokens=4, **change)
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == param, body
