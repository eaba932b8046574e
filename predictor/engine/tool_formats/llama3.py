"""Llama 3.x's JSON tool calls (parser `llama3_json`): `{"name": NAME, "parameters": ARGS}`,
at the answer's start or after `<|python_tag|>`, calls separated by `; `. The 3.1/3.2/3.3
templates render `tools` themselves (in the first user turn or the system turn), a call as
that JSON and a tool's answer as an `ipython` turn; they take one call per assistant turn, so
a turn of several calls goes as one turn per call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from predictor.engine.tool_formats.json_calls import JsonCalls
from predictor.engine.tool_formats.plain import has_tool_turns, instructions, plain

PYTHON_TAG = "<|python_tag|>"


def _render(
    conversation: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template: str | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    if template and "tools" in template:
        turns: list[dict[str, Any]] = []
        for message in conversation:
            calls = message.get("tool_calls") or []
            if message["role"] == "assistant" and len(calls) > 1:
                turns += [{**message, "tool_calls": [call]} for call in calls]
            else:
                turns.append(dict(message))
        return turns, ({"tools": list(tools)} if tools else {})
    if not tools and not has_tool_turns(conversation):
        return [dict(m) for m in conversation], {}
    example = LLAMA3_JSON.call_text("function name", {"argument": "value"})
    return plain(conversation, tools, template, LLAMA3_JSON.calls_text, instructions(example)), {}


LLAMA3_JSON = JsonCalls(
    name="llama3_json",
    key="parameters",
    block_begin="",
    block_end="",
    call_begin="",
    call_end="",
    separator="; ",
    begins=(PYTHON_TAG,),
    ends=(),
    at_start=True,
    renderer=_render,
)
