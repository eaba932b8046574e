"""The tool-call format: the prompt a template without tools gets, the grammar of each choice,
and the calls read back out of whole and streamed text alike."""

from __future__ import annotations

import json
import random

import pytest

from predictor.engine import tool_calls
from predictor.engine.grammar import Grammars
from predictor.engine.tool_calls import StreamParser, ToolCall, call_text, split
from predictor.errors import InvalidRequest
from predictor.types import Grammar
from tests.engine.conftest import Tiny

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}

TEXTS = {
    "plain text": ("Hello there", ("Hello there", [])),
    "one call": (
        call_text("get_weather", {"city": "Paris", "deep": {"a": [1, {"b": "}"}]}}),
        (None, [ToolCall("get_weather", '{"city": "Paris", "deep": {"a": [1, {"b": "}"}]}}')]),
    ),
    "text, then two calls": (
        "Let me check.\n" + call_text("f", {"x": 1}) + "\n" + call_text("g", {}),
        ("Let me check.", [ToolCall("f", '{"x": 1}'), ToolCall("g", "{}")]),
    ),
    "a call, then text": (
        call_text("f", {"x": 1}) + "\nDone.",
        ("Done.", [ToolCall("f", '{"x": 1}')]),
    ),
    "a marker's beginning is text": ("not a call <tool_ca", ("not a call <tool_ca", [])),
    "keys in another order": (
        '<tool_call>\n{"arguments": {"q": 1}, "name": "h"}\n</tool_call>',
        (None, [ToolCall("h", '{"q": 1}')]),
    ),
    "a block that is no call stays text": (
        "<tool_call>oops</tool_call> tail",
        ("<tool_call>oops</tool_call> tail", []),
    ),
    "cut off in the arguments": (
        call_text("f", {"x": [1, 2]})[:-16],
        (None, [ToolCall("f", '{"x": [1, 2')]),
    ),
    "cut off in the end marker": (
        call_text("f", {"x": 1})[:-5],
        (None, [ToolCall("f", '{"x": 1}')]),
    ),
}


def streamed(text: str, rng: random.Random) -> tuple[str | None, list[ToolCall]]:
    """The text fed in random pieces; the deltas put back together as a client would."""
    parser, deltas, at = StreamParser(), [], 0
    while at < len(text):
        size = rng.randint(1, 7)
        deltas += parser.feed(text[at : at + size])
        at += size
    deltas += parser.finish()
    content = "".join(d.text for d in deltas if d.kind == "content") or None
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.kind == "call":
            assert d.index == len(calls)  # a call's start comes once, in order
            calls[d.index] = [d.text, ""]
        elif d.kind == "arguments":
            calls[d.index][1] += d.text
    return content, [ToolCall(name, args) for name, args in calls.values()]


@pytest.mark.parametrize("case", TEXTS)
def test_split_reads_calls_and_text(case: str) -> None:
    text, expected = TEXTS[case]
    assert split(text) == expected


@pytest.mark.parametrize("case", TEXTS)
def test_any_streaming_gives_what_the_whole_text_gives(case: str) -> None:
    text, expected = TEXTS[case]
    rng = random.Random(case)
    for _ in range(200):
        assert streamed(text, rng) == expected


def test_streamed_arguments_come_before_the_call_ends() -> None:
    parser = StreamParser()
    text = call_text("f", {"city": "Paris", "country": "France"})
    head = text.index('"country"')
    deltas = parser.feed(text[:head])
    assert [d.kind for d in deltas] == ["call", "arguments"]
    assert deltas[0].text == "f" and deltas[1].text == '{"city": "Paris", '


def test_a_template_without_tools_gets_them_in_the_system_turn() -> None:
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris", "unit": "c"}}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
    ]  # fmt: skip
    tools = [{"type": "function", "function": WEATHER}]
    out = tool_calls.plain_conversation(conversation, tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(tools[0]) in out[0]["content"]
    assert split(out[2]["content"]) == (
        None, [ToolCall("get_weather", '{"city": "Paris", "unit": "c"}')]
    )  # fmt: skip
    assert out[3]["content"] == "<tool_response>\n18 C\n</tool_response>"
    assert tool_calls.plain_conversation(conversation[1:2], tools)[0]["role"] == "system"


def test_native_means_the_template_renders_tools_in_this_format() -> None:
    assert not tool_calls.native(None)
    assert not tool_calls.native("{% for message in messages %}{{ message.content }}{% endfor %}")
    assert tool_calls.native("{% if tools %}<tools>{{ tools }}</tools> <tool_call>{% endif %}")


def accepts(grammars: Grammars, grammar: str, text: str, tiny: Tiny) -> bool:
    matcher = grammars.matcher(grammars.compile(Grammar("structural_tag", grammar, "tools")))
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)
    # the whole text, and then the end: the grammar may stop there
    return all(matcher.accept(t) for t in ids) and matcher.accept(min(tiny.eos_ids))


def test_required_takes_calls_only_and_parallel_decides_how_many(
    grammars: Grammars, tiny_dense: Tiny
) -> None:
    good = call_text("get_weather", {"city": "Oslo", "unit": "c"})
    two = good + "\n" + call_text("get_time", {})
    many = tool_calls.structural_tag([WEATHER, TIME], "required", parallel=True)
    one = tool_calls.structural_tag([WEATHER, TIME], "required", parallel=False)
    assert accepts(grammars, many, good, tiny_dense) and accepts(grammars, many, two, tiny_dense)
    assert not accepts(grammars, one, two, tiny_dense)
    assert not accepts(grammars, many, "Sure. " + good, tiny_dense)  # nothing but calls
    bad = call_text("get_weather", {"city": "Oslo", "unit": "kelvin"})
    assert not accepts(grammars, many, bad, tiny_dense)


def test_a_named_tool_is_that_call_and_auto_lets_text_through(
    grammars: Grammars, tiny_dense: Tiny
) -> None:
    named = tool_calls.structural_tag([WEATHER, TIME], "get_time", parallel=True)
    assert accepts(grammars, named, call_text("get_time", {}), tiny_dense)
    assert not accepts(grammars, named, call_text("get_weather", {"city": "a", "unit": "f"}),
                       tiny_dense)  # fmt: skip
    auto = tool_calls.structural_tag([WEATHER], "auto", parallel=True)
    assert accepts(grammars, auto, "No call needed.", tiny_dense)
    call = call_text("get_weather", {"city": "Rome", "unit": "f"})
    assert accepts(grammars, auto, "Checking.\n" + call, tiny_dense)
    assert not accepts(grammars, auto, "<tool_call>\n{oops", tiny_dense)


def test_an_unenforceable_parameter_schema_is_refused_naming_tools(grammars: Grammars) -> None:
    schema = {"type": "object", "properties": {"mail": {"type": "string", "format": "email"}}}
    grammar = tool_calls.structural_tag([{"name": "f", "parameters": schema}], "required", True)
    with pytest.raises(InvalidRequest) as info:
        grammars.compile(Grammar("structural_tag", grammar, "tools"))
    assert info.value.param == "tools" and "format" in str(info.value)
