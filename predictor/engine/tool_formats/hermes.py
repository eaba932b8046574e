"""Hermes' tool-call format (parser `hermes`; the one Qwen2.5, Qwen3, Hermes and SmolLM3
templates write, and the default for a template that shows no tool format): each call is
`<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`, calls one per line, a tool's
answer `<tool_response>\\n...\\n</tool_response>` in a user turn. A chat template that renders
`tools` itself in this format gets them as HF templates take them (`tools=`, assistant
`tool_calls`, `tool` messages); any other template (SmolLM2's has no tools) gets the tools in the
system message and the history rewritten into plain turns, so the model's own template still
renders every turn.

`structural_tag` is the grammar (xgrammar's structural tag, as JSON text) that makes the calls
parse and their arguments validate: `required` one or more calls and nothing else, a named tool
exactly that call, `auto` free text in which a call, once begun, must complete. `split` and
`StreamParser` read the calls back out of whole and streamed text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from predictor.engine.tool_formats.base import (
    Choice,
    Delta,
    ToolCall,
    fold_system,
    schemas,
    split_with,
    tag,
)
from predictor.engine.tool_formats.base import held as _held

__all__ = ["Choice", "Delta", "ToolCall", "schemas"]

BEGIN = "<tool_call>"
END = "</tool_call>"
HEAD = '<tool_call>\n{"name": "'
ARGUMENTS = '", "arguments": '
TAIL = "}\n</tool_call>"
SEPARATOR = "\n"

SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


# -- the prompt --------------------------------------------------------------------------------


def native(template: str | None) -> bool:
    """Whether a chat template renders `tools` itself, in this format."""
    return bool(template) and "tools" in str(template) and BEGIN in str(template)


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f"{HEAD}{name}{ARGUMENTS}{args}{TAIL}"


def plain_conversation(
    conversation: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """A conversation with tools, for a template that knows nothing of them: the tools in the
    system message, assistant calls as the text the model writes, tool answers as user turns."""
    out: list[dict[str, Any]] = []
    for message in conversation:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                call_text(c["function"]["name"], c["function"]["arguments"])
                for c in message["tool_calls"]
            ]
            content = SEPARATOR.join(([content] if content else []) + calls)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        listed = "\n".join(json.dumps(dict(t), ensure_ascii=False) for t in tools)
        prompt = SYSTEM_PROMPT.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# -- the grammar -------------------------------------------------------------------------------


def _tag(function: Mapping[str, Any]) -> dict[str, Any]:
    return tag(f"{HEAD}{function['name']}{ARGUMENTS}", function, TAIL)


def structural_tag(functions: Sequence[Mapping[str, Any]], choice: Choice, parallel: bool) -> str:
    """The structural tag (JSON text) for the calls `choice` allows among `functions`."""
    tags = [_tag(f) for f in functions if choice in ("auto", "required") or f["name"] == choice]
    if choice == "auto":
        form: dict[str, Any] = {
            "type": "triggered_tags",
            "triggers": [BEGIN],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel,
        }
    elif choice == "required":
        form = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": SEPARATOR,
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
    else:
        (form,) = tags
    return json.dumps({"type": "structural_tag", "format": form}, ensure_ascii=False)


# -- reading calls back ------------------------------------------------------------------------

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _parse(block: str) -> ToolCall | None:
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        return ToolCall(call["name"], arguments)
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


def split(text: str) -> tuple[str | None, list[ToolCall]]:
    """Whole text -> the text outside the calls (None when there is none) and the calls, read
    exactly as `StreamParser` reads a stream of it."""
    return split_with(StreamParser(), text)


class StreamParser:
    """Streamed text -> deltas: content until a call begins, then the call's name once and its
    arguments as they come. Text that may be the start of a call's markers is held back."""

    def __init__(self) -> None:
        self._state: Literal["text", "header", "arguments"] = "text"
        self._buffer = ""
        self._fresh = False  # no character of the current call's arguments seen yet
        self._after_call = False  # a call just ended: whitespace after it is not content
        self.calls = 0  # calls begun

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        out: list[Delta] = []
        while True:
            before = (self._state, len(self._buffer))
            out.extend(getattr(self, f"_{self._state}")())
            if (self._state, len(self._buffer)) == before:
                return out

    def finish(self) -> list[Delta]:
        """Whatever is held back, at the end of the text."""
        rest, self._buffer = self._buffer, ""
        if self._state == "arguments":  # cut off inside a call
            rest = rest.rstrip()
            marker = _held(rest, END) or (len(END) if rest.endswith(END) else 0)
            if marker:  # the end marker begun: the brace before it is the call object's
                rest = rest[: len(rest) - marker].rstrip()
                rest = rest[:-1] if rest.endswith("}") else rest
            return [Delta("arguments", rest, self.calls - 1)] if rest else []
        if self._state == "header":  # cut off in a call's name: it stays text
            rest = BEGIN + rest
        rest = rest.strip() if self._after_call else rest.rstrip()
        return [Delta("content", rest)] if rest else []

    def _text(self) -> list[Delta]:
        """Content; whitespace next to a call is not: it waits, and goes if a call follows."""
        if self._after_call:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return []
            self._after_call = False
        at = self._buffer.find(BEGIN)
        if at >= 0:
            ready, self._buffer = self._buffer[:at].rstrip(), self._buffer[at + len(BEGIN) :]
            self._state = "header"
            return [Delta("content", ready)] if ready else []
        keep = _held(self._buffer, BEGIN)
        ready = self._buffer[: len(self._buffer) - keep].rstrip()
        self._buffer = self._buffer[len(ready) :]
        return [Delta("content", ready)] if ready else []

    def _header(self) -> list[Delta]:
        match = _HEADER.match(self._buffer)
        if match is None:
            end = self._buffer.find(END)
            if end < 0:
                return []
            # not the usual shape: the whole block, parsed at once, or text when it is no call
            block, self._buffer = self._buffer[:end], self._buffer[end + len(END) :]
            self._state = "text"
            call = _parse(block.strip())
            if call is None:
                return [Delta("content", BEGIN + block + END)]
            self.calls += 1
            self._after_call = True
            return [
                Delta("call", call.name, self.calls - 1),
                Delta("arguments", call.arguments, self.calls - 1),
            ]
        name = json.loads(f'"{match.group(1)}"')
        self._buffer = self._buffer[match.end() :]
        self._state = "arguments"
        self._fresh = True
        self.calls += 1
        return [Delta("call", name, self.calls - 1)]

    def _arguments(self) -> list[Delta]:
        if self._fresh:  # whitespace before the arguments' first character is not theirs
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return []
            self._fresh = False
        end = self._buffer.find(END)
        index = self.calls - 1
        if end >= 0:
            # the arguments, less the call object's own closing brace
            arguments = self._buffer[:end].rstrip()
            arguments = arguments[:-1].rstrip() if arguments.endswith("}") else arguments
            self._buffer = self._buffer[end + len(END) :]
            self._state, self._after_call = "text", True
            return [Delta("arguments", arguments, index)] if arguments else []
        # any closing brace may be the call object's: hold from the last one on
        last = self._buffer.rfind("}")
        ready = self._buffer if last < 0 else self._buffer[:last]
        self._buffer = self._buffer[len(ready) :]
        return [Delta("arguments", ready, index)] if ready else []


class Hermes:
    """The format as `ToolFormat` (engine/tool_formats/base.py)."""

    name = "hermes"
    markers = (BEGIN, END)

    def render(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        template: str | None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if native(template):
            return [dict(m) for m in conversation], ({"tools": list(tools)} if tools else {})
        if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in conversation):
            return fold_system(plain_conversation(conversation, tools), template), {}
        return [dict(m) for m in conversation], {}

    def structural_tag(
        self, functions: Sequence[Mapping[str, Any]], choice: Choice, parallel: bool
    ) -> str:
        return structural_tag(functions, choice, parallel)

    def parser(self) -> StreamParser:
        return StreamParser()
