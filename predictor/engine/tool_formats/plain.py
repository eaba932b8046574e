"""Tools for a chat template that does not render them (or not in the format asked for): the
tools in the system turn with the format's own instructions, assistant calls as the text the
model writes, tool answers as user turns; every turn then plain text the template takes."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from predictor.engine.tool_formats.base import fold_system

CallsText = Callable[[Sequence[tuple[str, Any]]], str]


def has_tool_turns(conversation: Sequence[Mapping[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in conversation)


def plain(
    conversation: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template: str | None,
    calls_text: CallsText,
    instructions: str,
    answer: Callable[[str], str] | None = None,
) -> list[dict[str, Any]]:
    """`instructions` names the tools' place with `{tools}` (one JSON object a line); `answer`
    writes a tool's answer as the user turn's text (default: `Tool result: ...`)."""
    out: list[dict[str, Any]] = []
    for message in conversation:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = calls_text(
                [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            )
            out.append(
                {"role": "assistant", "content": f"{content}\n{calls}" if content else calls}
            )
        elif role == "tool":
            text = answer(content) if answer else f"Tool result: {content}"
            out.append({"role": "user", "content": text})
        else:
            out.append({"role": role, "content": content})
    if tools:
        listed = "\n".join(json.dumps(dict(t), ensure_ascii=False) for t in tools)
        prompt = instructions.replace("{tools}", listed)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return fold_system(out, template)


def instructions(example: str) -> str:
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query. The "
        "functions, one JSON object a line:\n{tools}\n\nTo call functions, answer with only "
        f"this:\n{example}"
    )
