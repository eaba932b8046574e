"""Phi-4-mini's tool calls (parser `phi4_mini_json`): each call
`<|tool_call|>{"name": NAME, "arguments": ARGS}<|/tool_call|>` (a JSON list inside, and vLLM's
`functools[...]`, are read too). Phi-4-mini-instruct's template takes the tools as a JSON text
in the system turn's `tools` field (`<|tool|>...<|/tool|>`) and renders every other turn as
`<|role|>content<|end|>`: calls go as their text, tool answers as `tool` turns."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from predictor.engine.tool_formats.json_calls import JsonCalls
from predictor.engine.tool_formats.plain import has_tool_turns, instructions, plain

BEGIN = "<|tool_call|>"
END = "<|/tool_call|>"


def _render(
    conversation: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template: str | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    if not tools and not has_tool_turns(conversation):
        return [dict(m) for m in conversation], {}
    if not template or "message['tools']" not in template:
        example = PHI4_MINI_JSON.call_text("function name", {"argument": "value"})
        text = PHI4_MINI_JSON.calls_text
        return plain(conversation, tools, template, text, instructions(example)), {}
    turns: list[dict[str, Any]] = []
    for message in conversation:
        content = message.get("content") or ""
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = [
                (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
            ]
            content += PHI4_MINI_JSON.calls_text(calls)
        turns.append({"role": message["role"], "content": content})
    if tools:
        listed = json.dumps([dict(t.get("function", t)) for t in tools], ensure_ascii=False)
        if not turns or turns[0]["role"] != "system":
            turns.insert(
                0, {"role": "system", "content": "You are a helpful assistant with some tools."}
            )
        turns[0] = {**turns[0], "tools": listed}
    return turns, {}


PHI4_MINI_JSON = JsonCalls(
    name="phi4_mini_json",
    key="arguments",
    block_begin="",
    block_end="",
    call_begin=BEGIN,
    call_end=END,
    separator="",
    begins=(BEGIN, "functools["),
    ends=(END,),
    renderer=_render,
)
