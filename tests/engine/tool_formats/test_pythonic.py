"""The pythonic tool-call format (Gemma's; engine/tool_formats/pythonic.py): lists of calls and
tool_code blocks read whole and streamed split at every position, only literal arguments taken
(anything else stays text), the grammar writing Python calls that validate against the tools'
schemas and that the parser reads back."""

from __future__ import annotations

import json

import pytest

from predictor.engine import tool_formats
from predictor.engine.grammar import Grammars
from predictor.engine.tool_formats.base import Delta, ToolCall, split_with
from predictor.engine.tool_formats.pythonic import (
    PYTHONIC,
    StreamParser,
    call_text,
    calls_text,
    structural_tag,
)
from tests.engine.conftest import Tiny
from tests.engine.test_tool_calls import TIME, WEATHER, accepts

PARIS = ToolCall("get_weather", '{"city": "Paris", "unit": "c"}')

CASES: dict[str, tuple[str, tuple[str | None, list[ToolCall]]]] = {
    "plain text": ("Hello there", ("Hello there", [])),
    "a list of one call": ('[get_weather(city="Paris", unit="c")]', (None, [PARIS])),
    "two calls": (
        '[f(x=1), g()]', (None, [ToolCall("f", '{"x": 1}'), ToolCall("g", "{}")])
    ),
    "text, then calls": ('Let me check. [get_weather(city="Paris", unit="c")]',
                         ("Let me check.", [PARIS])),
    "a tool_code block": (
        'Sure.\n```tool_code\nget_weather(city="Paris", unit="c")\n```', ("Sure.", [PARIS])
    ),
    "a tool_code block, a call a line": (
        "```tool_code\nf(x=1)\ng(y=[1, 2])\n```",
        (None, [ToolCall("f", '{"x": 1}'), ToolCall("g", '{"y": [1, 2]}')]),
    ),
    "a tool_code block holding a list": ("```tool_code\n[f(x=1)]\n```",
                                         (None, [ToolCall("f", '{"x": 1}')])),
    "values of every literal kind": (
        "[f(s='a, b)', n=-1.5, i=+2, t=True, z=None, l=[1, (2, 3)], d={'k': {'j': false}})]",
        (None, [ToolCall("f", '{"s": "a, b)", "n": -1.5, "i": 2, "t": true, "z": null, '
                              '"l": [1, [2, 3]], "d": {"k": {"j": false}}}')]),
    ),
    "keys Python keeps for itself, names that are no identifiers": (
        '[convert-money(from="USD", to="EUR")]',
        (None, [ToolCall("convert-money", '{"from": "USD", "to": "EUR"}')]),
    ),
    "names and keys in any script": ('[météo(città="Roma")]',
                                     (None, [ToolCall("météo", '{"città": "Roma"}')])),
    "a call then text": ("[f(x=1)]\nDone.", ("Done.", [ToolCall("f", '{"x": 1}')])),
    "cut off in the second call: that one is text": (
        '[f(x=1), g(y="ab', ('g(y="ab', [ToolCall("f", '{"x": 1}')])
    ),
    "cut off in the tool_code block's end": ("```tool_code\nf(x=1)\n``",
                                             (None, [ToolCall("f", '{"x": 1}')])),
    "brackets that hold no call are text": ("See [the docs] and [f].", ("See [the docs] and [f].", [])),
    "a positional argument is no call": ("[f(1)] and [g(x)]", ("[f(1)] and [g(x)]", [])),
    "a call in an argument is no call": ("a [f(x=g())] b", ("a [f(x=g())] b", [])),
    "a name in an argument is no call": ("[f(x=y)]", ("[f(x=y)]", [])),
    "an expression is no call": ("[f(x=1 + 2)]", ("[f(x=1 + 2)]", [])),
    "a key given twice is no call": ("[f(x=1, x=2)]", ("[f(x=1, x=2)]", [])),
    "dict keys must be strings": ("[f(x={1: 2})]", ("[f(x={1: 2})]", [])),
    "a tool_code block without a call is text": (
        "```tool_code\nimport os\n```", ("```tool_code\nimport os\n```", [])
    ),
}  # fmt: skip


def joined(deltas: list[Delta]) -> tuple[str | None, list[ToolCall]]:
    content = "".join(d.text for d in deltas if d.kind == "content") or None
    made: dict[int, list[str]] = {}
    for d in deltas:
        if d.kind == "call":
            assert d.index == len(made)
            made[d.index] = [d.text, ""]
        elif d.kind == "arguments":
            made[d.index][1] += d.text
    return content, [ToolCall(n, a) for n, a in made.values()]


@pytest.mark.parametrize("case", list(CASES))
def test_calls_read_whole_and_streamed_split_anywhere(case: str) -> None:
    text, expected = CASES[case]
    assert split_with(StreamParser(), text) == expected
    for cut in range(len(text) + 1):
        parser = StreamParser()
        deltas = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
        assert joined(deltas) == expected, cut
    parser = StreamParser()
    deltas = [d for ch in text for d in parser.feed(ch)] + parser.finish()
    assert joined(deltas) == expected


def test_each_call_goes_out_once_its_parenthesis_closes() -> None:
    parser = StreamParser()
    first = parser.feed('[get_weather(city="Paris", unit="c"), f(')
    assert joined(first) == (None, [PARIS])
    assert parser.calls == 1
    assert parser.feed("x=1)]") + parser.finish() == [
        Delta("call", "f", 1), Delta("arguments", '{"x": 1}', 1)
    ]  # fmt: skip


def test_calls_are_written_as_python_and_read_back() -> None:
    made = calls_text([("f", {"a": True, "b": None, "c": [1, "x"], "d": {"k": 1.5}}),
                       ("g", '{"z": "q\\"uote"}')])  # fmt: skip
    assert made == '[f(a=True, b=None, c=[1, "x"], d={"k": 1.5}), g(z="q\\"uote")]'
    assert split_with(StreamParser(), made) == (
        None,
        [ToolCall("f", '{"a": true, "b": null, "c": [1, "x"], "d": {"k": 1.5}}'),
         ToolCall("g", '{"z": "q\\"uote"}')],
    )  # fmt: skip
    assert call_text("f", "not json") == "f(not json)"  # shown as given


def test_the_format_is_chosen_by_name_and_renders_tools_for_a_template_without_them() -> None:
    assert tool_formats.get("pythonic") is PYTHONIC
    conversation = [{"role": "user", "content": "Weather in Paris?"}]
    assert PYTHONIC.render(conversation, None, None) == (conversation, {})
    turns, extra = PYTHONIC.render(conversation, [{"type": "function", "function": WEATHER}], None)
    assert extra == {} and turns[0]["role"] == "system"
    assert '[function_name(argument="value")]' in turns[0]["content"]
    assert json.dumps({"type": "function", "function": WEATHER}) in turns[0]["content"]


NESTED = {
    "name": "book",
    "parameters": {
        "type": "object",
        "properties": {
            "note": {"type": "string"},
            "room": {"$ref": "#/$defs/room"},
            "late": {"type": "boolean"},
            "guests": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["room"],
        "$defs": {"room": {"type": "object", "properties": {"beds": {"type": "integer"}},
                           "required": ["beds"], "additionalProperties": False}},
    },
}  # fmt: skip
ANY = {"name": "anything", "parameters": {"type": "object"}}


def test_the_grammar_takes_the_formats_own_calls_only(grammars: Grammars, tiny_dense: Tiny) -> None:
    def ok(grammar: str, text: str) -> bool:
        return accepts(grammars, grammar, text, tiny_dense)

    required = structural_tag([WEATHER, TIME], "required", parallel=True)
    single = structural_tag([WEATHER, TIME], "required", parallel=False)
    named = structural_tag([WEATHER, TIME], "get_time", parallel=True)
    auto = structural_tag([WEATHER, TIME], "auto", parallel=True)
    auto_single = structural_tag([WEATHER, TIME], "auto", parallel=False)
    one = calls_text([("get_weather", {"city": "Oslo", "unit": "c"})])
    two = calls_text([("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {})])
    assert ok(required, one) and ok(required, two)
    assert not ok(single, two)
    assert not ok(required, "Sure. " + one)
    assert not ok(required, calls_text([("get_weather", {"city": "Oslo", "unit": "kelvin"})]))
    assert not ok(required, calls_text([("get_weather", {"city": "Oslo"})]))  # unit is required
    assert not ok(required, '[get_weather(unit="c", city="Oslo")]')  # the schema's order
    assert ok(named, "[get_time()]") and not ok(named, one)
    assert ok(auto, "No call needed.") and ok(auto, one) and ok(auto, "Let me see. " + two)
    assert not ok(auto_single, two) and ok(auto_single, one)
    assert not ok(auto, '[get_weather(city="Oslo")]')  # a call, once begun, completes
    # optional properties, a `$ref` into the parameters' own `$defs`, Python's booleans
    nested = structural_tag([NESTED], "required", parallel=False)
    assert ok(nested, '[book(room={"beds": 2})]')
    assert ok(nested, '[book(note="x", room={"beds": 2}, late=True, guests=[1, 2])]')
    assert not ok(nested, '[book(room={"beds": 2}, late=true)]')
    assert not ok(nested, '[book(note="x")]')
    assert not ok(nested, '[book(room={"beds": "two"})]')
    # a schema without properties: any keyword arguments
    anything = structural_tag([ANY], "required", parallel=False)
    assert ok(anything, "[anything()]") and ok(anything, '[anything(a=1, b_2={"c": [null]})]')
    # what the grammar takes, the parser reads back
    assert split_with(StreamParser(), two)[1] == [
        ToolCall("get_weather", '{"city": "Oslo", "unit": "c"}'), ToolCall("get_time", "{}")
    ]  # fmt: skip
