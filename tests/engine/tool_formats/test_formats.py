"""Each tool-call format (engine/tool_formats/): chosen from the template's text, its calls read
whole and streamed split at every position, parallel calls, malformed text left as content,
its grammar taking its own calls only, and a tool round trip rendered through the family's
real chat template (templates/, their sources in templates/README.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from predictor.engine import tool_formats
from predictor.engine.grammar import Grammars
from predictor.engine.tool_formats.base import Delta, ToolCall, split_with
from predictor.engine.tool_formats.json_calls import JsonCalls
from predictor.engine.tool_formats.mistral import short_id
from tests.engine.conftest import Tiny
from tests.engine.test_tool_calls import TIME, WEATHER, accepts

TEMPLATES = Path(__file__).parent / "templates"
JSON_FORMATS = ("llama3_json", "mistral", "phi4_mini_json")


def fmt(name: str) -> JsonCalls:
    found = tool_formats.get(name)
    assert isinstance(found, JsonCalls)
    return found


def calls(name: str, *made: tuple[str, dict[str, Any]]) -> str:
    return fmt(name).calls_text(list(made))


def cases(name: str) -> dict[str, tuple[str, tuple[str | None, list[ToolCall]]]]:
    one = calls(name, ("get_weather", {"city": "Paris", "deep": {"a": [1, {"b": "}]"}]}}))
    two = calls(name, ("f", {"x": 1}), ("g", {}))
    cut = two.index('{"name": "g"') + 15
    one_call = ("get_weather", '{"city": "Paris", "deep": {"a": [1, {"b": "}]"}]}}')
    return {
        "plain text": ("Hello there", ("Hello there", [])),
        "one call": (
            one,
            (None, [ToolCall(*one_call)]),
        ),
        "two calls": (two, (None, [ToolCall("f", '{"x": 1}'), ToolCall("g", "{}")])),
        "cut off in the second call: that one is text": (
            two[:cut],
            (
                two[two.index(fmt(name).call_begin + '{"name": "g"') : cut],
                [ToolCall("f", '{"x": 1}')],
            ),
        ),
        "cut off in the end marker": (
            one[:-3] if fmt(name).call_end else one,
            (None, [ToolCall(*one_call)]),
        ),
        "a marker then no call is text": (
            (fmt(name).begins or ("",))[0] + " oops",
            ((fmt(name).begins or ("",))[0] + " oops", []),
        ),
    }


def streamed(parser: Any, text: str, cut: int) -> list[Delta]:
    return parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()


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


@pytest.mark.parametrize("name", JSON_FORMATS)
def test_calls_read_whole_and_streamed_split_anywhere(name: str) -> None:
    for case, (text, expected) in cases(name).items():
        assert split_with(fmt(name).parser(), text) == expected, case
        for cut in range(len(text) + 1):
            assert joined(streamed(fmt(name).parser(), text, cut)) == expected, (case, cut)
        # and a character at a time
        parser = fmt(name).parser()
        deltas = [d for ch in text for d in parser.feed(ch)] + parser.finish()
        assert joined(deltas) == expected, case


@pytest.mark.parametrize("name", JSON_FORMATS)
def test_text_before_calls_is_content(name: str) -> None:
    text = "Let me check. " + calls(name, ("f", {"x": 1}))
    content, made = split_with(fmt(name).parser(), text)
    if name == "llama3_json":  # Llama 3: calls open the answer, or follow <|python_tag|>
        assert (content, made) == (text, [])
        text = "Let me check. <|python_tag|>" + calls(name, ("f", {"x": 1}))
        content, made = split_with(fmt(name).parser(), text)
    assert (content, made) == ("Let me check.", [ToolCall("f", '{"x": 1}')])


def test_other_spellings_are_read() -> None:
    llama = fmt("llama3_json").parser()
    text = '<|python_tag|>{"name": "f", "arguments": {"x": 1}}; {"name": "g", "parameters": {}}'
    assert split_with(llama, text) == (None, [ToolCall("f", '{"x": 1}'), ToolCall("g", "{}")])
    v11 = '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}'
    assert split_with(fmt("mistral").parser(), v11) == (
        None, [ToolCall("get_time", '{"zone": "UTC"}')]
    )  # fmt: skip
    phi = '<|tool_call|>[{"name": "f", "arguments": {}}]<|/tool_call|>'
    assert split_with(fmt("phi4_mini_json").parser(), phi) == (None, [ToolCall("f", "{}")])
    functools = 'functools[{"name": "f", "arguments": {"a": "b"}}]'
    assert split_with(fmt("phi4_mini_json").parser(), functools) == (
        None, [ToolCall("f", '{"a": "b"}')]
    )  # fmt: skip


@pytest.mark.parametrize("name", JSON_FORMATS)
def test_an_object_that_is_no_call_stays_text(name: str) -> None:
    begin = fmt(name).block_begin or fmt(name).call_begin
    text = begin + '{"answer": 42}' + fmt(name).call_end + fmt(name).block_end
    assert split_with(fmt(name).parser(), text) == (text, [])


@pytest.mark.parametrize(
    ("template", "name"),
    [
        ("llama-3.2.jinja", "llama3_json"),
        ("mistral-7b-instruct-v0.3.jinja", "mistral"),
        ("phi-4-mini-instruct.jinja", "phi4_mini_json"),
        ("gemma-3.jinja", "pythonic"),
        ("qwen3.jinja", "hermes"),
        (None, "hermes"),
    ],
)
def test_the_template_text_chooses_the_format(template: str | None, name: str) -> None:
    text = (TEMPLATES / template).read_text() if template else None
    assert tool_formats.choose(text).name == name
    assert tool_formats.choose(text, "mistral").name == "mistral"  # the override wins
    assert tool_formats.get("qwen").name == "hermes"  # vLLM's other names
    with pytest.raises(KeyError):
        tool_formats.get("granite")


ROUND_TRIP: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "21 C"},
]  # fmt: skip


@pytest.mark.parametrize(
    ("template", "wants"),
    [
        ("llama-3.2.jinja", ['"parameters": {"city": "Rome", "unit": "c"}}', "ipython", "21 C"]),
        ("mistral-7b-instruct-v0.3.jinja",
         ["[AVAILABLE_TOOLS]", f'"id": "{short_id("call_2")}"', "[TOOL_RESULTS]", "21 C"]),
        ("phi-4-mini-instruct.jinja",
         ["<|tool|>[{", '<|tool_call|>{"name": "get_weather", "arguments": {"city": "Rome"',
          "<|tool|>21 C<|end|>"]),
        ("gemma-3.jinja",
         ['[get_weather(city="Paris", unit="c"), get_weather(city="Rome", unit="c")]',
          "```tool_output\n18 C\n```\n\n```tool_output\n21 C\n```", "Be brief."]),
        ("qwen3.jinja", ["<tools>\n{", '<tool_call>\n{"name": "get_weather"', "<tool_response>\n21 C"]),
    ],
)  # fmt: skip
def test_a_tool_round_trip_renders_through_the_real_template(
    template: str, wants: list[str], tiny_dense: Tiny
) -> None:
    text = (TEMPLATES / template).read_text()
    chosen = tool_formats.choose(text)
    tools = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
    turns, extra = chosen.render(ROUND_TRIP, tools, text)
    rendered = tiny_dense.tokenizer.apply_chat_template(
        turns, chat_template=text, add_generation_prompt=True, tokenize=False, **extra
    )
    assert "get_time" in rendered  # the tools are shown
    for want in wants:
        assert want in rendered, (want, rendered)


def test_mistral_ids_are_nine_letters_and_digits() -> None:
    for given in ("call_1", "call_abcdef0123456789", "x", "abcdefghi"):
        made = short_id(given)
        assert len(made) == 9 and made.isalnum() and made == short_id(given)
    assert short_id("abcdefghi") == "abcdefghi"


@pytest.mark.parametrize("name", JSON_FORMATS)
def test_the_grammar_takes_the_formats_own_calls_only(
    name: str, grammars: Grammars, tiny_dense: Tiny
) -> None:
    good = ("get_weather", {"city": "Oslo", "unit": "c"})
    required = fmt(name).structural_tag([WEATHER, TIME], "required", parallel=True)
    single = fmt(name).structural_tag([WEATHER, TIME], "required", parallel=False)
    named = fmt(name).structural_tag([WEATHER, TIME], "get_time", parallel=True)
    auto = fmt(name).structural_tag([WEATHER, TIME], "auto", parallel=True)
    one, two = calls(name, good), calls(name, good, ("get_time", {}))
    assert accepts(grammars, required, one, tiny_dense)
    assert accepts(grammars, required, two, tiny_dense)
    assert not accepts(grammars, single, two, tiny_dense)
    assert not accepts(grammars, required, "Sure. " + one, tiny_dense)
    bad = calls(name, ("get_weather", {"city": "Oslo", "unit": "kelvin"}))
    assert not accepts(grammars, required, bad, tiny_dense)
    assert accepts(grammars, named, calls(name, ("get_time", {})), tiny_dense)
    assert not accepts(grammars, named, one, tiny_dense)
    assert accepts(grammars, auto, "No call needed.", tiny_dense)
    assert accepts(grammars, auto, one, tiny_dense)
    # what the grammar makes, the parser reads back
    assert split_with(fmt(name).parser(), two)[1] == [
        ToolCall("get_weather", '{"city": "Oslo", "unit": "c"}'), ToolCall("get_time", "{}")
    ]  # fmt: skip
