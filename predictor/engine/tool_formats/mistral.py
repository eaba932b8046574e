"""Mistral's tool calls (parser `mistral`): `[TOOL_CALLS][{"name": NAME, "arguments": ARGS},
...]`; the v11+ tokenizers' `[TOOL_CALLS]NAME[ARGS]{...}` is read too. The v0.3 / Nemo /
Ministral templates render `tools` as `[AVAILABLE_TOOLS]`, calls as `[TOOL_CALLS]` and answers
as `[TOOL_RESULTS]`, and refuse a call id that is not 9 letters and digits: ids are mapped to
such ids (the same id always to the same one) for the template."""

from __future__ import annotations

import hashlib
import string
from collections.abc import Mapping, Sequence
from typing import Any

from predictor.engine.tool_formats.json_calls import JsonCalls
from predictor.engine.tool_formats.plain import has_tool_turns, instructions, plain

MARKER = "[TOOL_CALLS]"
_ALPHABET = string.ascii_letters + string.digits


def short_id(call_id: str) -> str:
    """A 9-character alphanumeric id for any id (Mistral's templates refuse others)."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    out = []
    for _ in range(9):
        number, digit = divmod(number, len(_ALPHABET))
        out.append(_ALPHABET[digit])
    return "".join(out)


def _render(
    conversation: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template: str | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    if template and "tools" in template:
        turns: list[dict[str, Any]] = []
        for message in conversation:
            turn = dict(message)
            if turn.get("tool_calls"):
                turn["tool_calls"] = [{**c, "id": short_id(c["id"])} for c in turn["tool_calls"]]
            if "tool_call_id" in turn:
                turn["tool_call_id"] = short_id(turn["tool_call_id"])
            turns.append(turn)
        return turns, ({"tools": list(tools)} if tools else {})
    if not tools and not has_tool_turns(conversation):
        return [dict(m) for m in conversation], {}
    example = MISTRAL.calls_text([("function name", {"argument": "value"})])
    return plain(conversation, tools, template, MISTRAL.calls_text, instructions(example)), {}


MISTRAL = JsonCalls(
    name="mistral",
    key="arguments",
    block_begin=f"{MARKER}[",
    block_end="]",
    call_begin="",
    call_end="",
    separator=", ",
    begins=(MARKER,),
    ends=(),
    bare_names=True,
    renderer=_render,
)
