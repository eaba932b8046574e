"""Formats whose calls are JSON objects `{"name": ..., <key>: {...}}` after a marker: Llama 3's
(`parameters`, calls at the answer's start or after `<|python_tag|>`, `; ` between them),
Mistral's (`[TOOL_CALLS]` and a JSON list) and Phi-4-mini's (`<|tool_call|>...<|/tool_call|>`
around each). `JsonCalls` holds what differs; one stream parser reads them all.

The parser, after a begin marker: separators (`[`, `,`, `;`, whitespace) are skipped, each
object is read whole once it closes (its name and arguments go out as one call), an end marker
or anything else ends the calls. Text that is no call (an object without a string `name`, JSON
cut off at the end) is content, the marker included, as the model wrote it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from predictor.engine.tool_formats.base import (
    BlockParser,
    Choice,
    Delta,
    arguments_text,
    held,
    tag,
)

_DECODER = json.JSONDecoder()
_SKIP = " \t\r\n[],;"
_BARE = re.compile(r"([A-Za-z0-9_.-]+)\[ARGS\]")  # Mistral v11+: [TOOL_CALLS]name[ARGS]{...}
_BARE_PREFIX = re.compile(r"[A-Za-z0-9_.-]+(\[(A(R(G(S)?)?)?)?)?")


@dataclass(frozen=True)
class JsonCalls:
    """A JSON-call format. The grammar writes `block_begin`, then each call as
    `call_begin{"name": "NAME", "<key>": ARGS}call_end`, `separator` between calls, then
    `block_end`; the parser also takes the other `begins` and the keys in `keys`."""

    name: str
    key: str  # the arguments' key the grammar writes
    block_begin: str
    block_end: str
    call_begin: str
    call_end: str
    separator: str
    begins: tuple[str, ...]  # markers that open calls, as the parser reads them
    ends: tuple[str, ...]  # markers that close them
    keys: tuple[str, ...] = ("arguments", "parameters")
    at_start: bool = False  # a bare `{` that opens the answer begins calls (Llama 3)
    bare_names: bool = False  # `name[ARGS]{...}` calls (Mistral v11+)
    renderer: Any = field(default=None, compare=False)  # (conversation, tools, template) -> ...

    @property
    def markers(self) -> tuple[str, ...]:
        return self.begins + self.ends

    # -- the prompt --------------------------------------------------------------------------
    def render(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        template: str | None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        assert self.renderer is not None
        result: tuple[list[dict[str, Any]], dict[str, Any]] = self.renderer(
            conversation, tools, template
        )
        return result

    def call_text(self, name: str, arguments: Any) -> str:
        head = json.dumps({"name": name}, ensure_ascii=False)[:-1]
        return (
            f'{self.call_begin}{head}, "{self.key}": {arguments_text(arguments)}}}{self.call_end}'
        )

    def calls_text(self, calls: Sequence[tuple[str, Any]]) -> str:
        inner = self.separator.join(self.call_text(n, a) for n, a in calls)
        return f"{self.block_begin}{inner}{self.block_end}"

    # -- the grammar -------------------------------------------------------------------------
    def _tag(self, function: Mapping[str, Any]) -> dict[str, Any]:
        head = json.dumps({"name": function["name"]}, ensure_ascii=False)[:-1]
        return tag(f'{self.call_begin}{head}, "{self.key}": ', function, f"}}{self.call_end}")

    def structural_tag(
        self, functions: Sequence[Mapping[str, Any]], choice: Choice, parallel: bool
    ) -> str:
        tags = [
            self._tag(f) for f in functions if choice in ("auto", "required") or f["name"] == choice
        ]
        calls: dict[str, Any] = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": self.separator,
            "at_least_one": True,
            "stop_after_first": not parallel or choice not in ("auto", "required"),
        }
        block = calls
        if self.block_begin or self.block_end:
            block = {
                "type": "tag",
                "begin": self.block_begin,
                "content": calls,
                "end": self.block_end,
            }
        if choice == "auto":
            trigger = self.block_begin or self.call_begin or '{"name": "'
            form: dict[str, Any] = {
                "type": "triggered_tags",
                "triggers": [trigger],
                "tags": [block],
                "at_least_one": False,
                "stop_after_first": True,
            }
            if not self.block_begin:  # each call its own tag (Phi-4-mini), or none (Llama 3)
                form["tags"] = tags
                form["triggers"] = [self.call_begin or '{"name": "']
                form["stop_after_first"] = not parallel
            return json.dumps({"type": "structural_tag", "format": form}, ensure_ascii=False)
        return json.dumps({"type": "structural_tag", "format": block}, ensure_ascii=False)

    def parser(self) -> JsonCallParser:
        return JsonCallParser(self)


class JsonCallParser(BlockParser):
    """Streamed text -> deltas for a `JsonCalls` format (see the module's docstring)."""

    def __init__(self, fmt: JsonCalls) -> None:
        self._fmt = fmt
        self._buffer = ""
        self._in_calls = False
        self._block = ""  # the current block's text so far, marker included
        self._block_calls = 0  # calls read in the current block
        self._started = False  # content or calls went out
        self.calls = 0

    def _in_block(self) -> bool:
        return self._in_calls

    def _text(self) -> list[Delta]:
        fmt = self._fmt
        if fmt.at_start and not self._started:
            stripped = self._buffer.lstrip()
            if not stripped:
                return []
            if stripped.startswith("{"):
                self._open(len(self._buffer) - len(stripped), 0)
                return []
        found = [(self._buffer.find(b), b) for b in fmt.begins]
        found = [(at, b) for at, b in found if at >= 0]
        if found:
            at, begin = min(found)
            ready = self._buffer[:at]
            ready = ready.strip() if self._block_calls else ready.rstrip()
            self._open(at, len(begin))
            return self._content(ready)
        if self._block_calls:  # whitespace after calls is not content
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return []
            self._block_calls = 0
        keep = max((held(self._buffer, b) for b in fmt.begins), default=0)
        # whitespace before a possible marker waits: it goes if a call follows
        ready = self._buffer[: len(self._buffer) - keep].rstrip()
        self._buffer = self._buffer[len(ready) :]
        return self._content(ready)

    def _content(self, text: str) -> list[Delta]:
        if not text:
            return []
        self._started = True
        return [Delta("content", text)]

    def _open(self, at: int, marker: int) -> None:
        self._block = self._buffer[at : at + marker]
        self._buffer = self._buffer[at + marker :]
        self._in_calls, self._block_calls = True, 0

    def _close(self, text: str) -> list[Delta]:
        """The calls end; `text` (what is not a call) goes back to text, with the block's own
        text before it when the block held no call."""
        self._in_calls = False
        self._buffer = text + self._buffer
        if self._block_calls == 0:
            block, self._block = self._block, ""
            self._started = True
            return [Delta("content", block)] if block else []
        return []

    def _calls(self, final: bool) -> list[Delta]:
        fmt = self._fmt
        skipped = len(self._buffer) - len(self._buffer.lstrip(_SKIP))
        self._block += self._buffer[:skipped]
        self._buffer = self._buffer[skipped:]
        if not self._buffer:
            return self._close("") if final else []
        for end in fmt.ends:
            if self._buffer.startswith(end):
                self._buffer = self._buffer[len(end) :]
                self._in_calls = False
                return []
        if self._buffer.startswith("{"):
            try:
                value, size = _DECODER.raw_decode(self._buffer)
            except ValueError:
                if not final:
                    return []
                rest, self._buffer = self._buffer, ""
                return self._close(rest)
            call = self._call(value)
            if call is None:
                rest, self._buffer = self._buffer, ""
                return self._close(rest) if final else self._close_partial(rest, size)
            self._block += self._buffer[:size]
            self._buffer = self._buffer[size:]
            return self._emit(*call)
        if fmt.bare_names:
            match = _BARE.match(self._buffer)
            if match is not None:
                tail = self._buffer[match.end() :].lstrip()
                try:
                    value, size = _DECODER.raw_decode(tail)
                except ValueError:
                    if not final:
                        return []
                    value, size = None, 0
                if isinstance(value, dict):
                    self._buffer = tail[size:]
                    return self._emit(match.group(1), value)
            elif not final and _BARE_PREFIX.fullmatch(self._buffer):
                return []
        if any(e.startswith(self._buffer) for e in fmt.ends):
            if final:  # cut off in the end marker: the calls are whole
                self._buffer, self._in_calls = "", False
            return []
        rest, self._buffer = self._buffer, ""
        return self._close(rest)

    def _close_partial(self, rest: str, size: int) -> list[Delta]:
        out = self._close(rest[:size])
        self._buffer += rest[size:]
        return out

    def _call(self, value: Any) -> tuple[str, Any] | None:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        for key in self._fmt.keys:
            if key in value:
                return value["name"], value[key]
        return value["name"], {}

    def _emit(self, name: str, arguments: Any) -> list[Delta]:
        index = self.calls
        self.calls += 1
        self._block_calls += 1
        self._started = True
        return [Delta("call", name, index), Delta("arguments", arguments_text(arguments), index)]
