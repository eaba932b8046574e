"""What every tool-call format shares: the calls read back, the deltas of a stream, the
interface one format implements (`ToolFormat`), and the helpers the formats use."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

Choice = Literal["auto", "required"] | str  # a str other than those: the one tool to call
MAX_WHITESPACE = 1  # consecutive whitespace characters inside constrained arguments


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Delta:
    """A piece of a streamed answer: text, a call's start (its name), or a call's arguments."""

    kind: Literal["content", "call", "arguments"]
    text: str
    index: int = 0  # the call's index among this choice's calls


class Parser(Protocol):
    """Streamed text -> deltas; `finish` gives what is held back at the end of the text."""

    calls: int  # calls begun

    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...


class BlockParser:
    """The feed / finish loop of a parser whose text alternates content and blocks of calls:
    `_text` reads content up to a block's opening (holding back what may begin one), `_calls`
    reads the open block's calls (`final`: the text has ended); each consumes what it read of
    `_buffer`, and the loop runs while one makes progress. What is left at the end is content,
    stripped where calls came before it."""

    _buffer: str
    _block_calls: int  # calls read in the block last opened

    def _in_block(self) -> bool:
        raise NotImplementedError

    def _text(self) -> list[Delta]:
        raise NotImplementedError

    def _calls(self, final: bool) -> list[Delta]:
        raise NotImplementedError

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        out: list[Delta] = []
        while True:
            before = (self._in_block(), len(self._buffer))
            out.extend(self._calls(final=False) if self._in_block() else self._text())
            if (self._in_block(), len(self._buffer)) == before:
                return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        while self._buffer or self._in_block():
            if not self._in_block():
                rest, self._buffer = self._buffer, ""
                rest = rest.strip() if self._block_calls else rest.rstrip()
                out += [Delta("content", rest)] if rest else []
                break
            out += self._calls(final=True)
        return out


class ToolFormat(Protocol):
    """One family's tool-call format: how tools and tool turns reach the chat template, the
    grammar that forces calls in it, and the parser that reads them back."""

    @property
    def name(self) -> str:
        """Its parser name (vLLM's)."""
        ...

    def render(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        template: str | None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The conversation and the extra keyword arguments for `apply_chat_template`."""
        ...

    def structural_tag(
        self, functions: Sequence[Mapping[str, Any]], choice: Choice, parallel: bool
    ) -> str:
        """xgrammar's structural tag (JSON text) for the calls `choice` allows."""
        ...

    def parser(self) -> Parser: ...

    @property
    def markers(self) -> tuple[str, ...]:
        """The texts that open and close calls: where a tokenizer holds one as a special token
        (Mistral's [TOOL_CALLS], Phi-4-mini's <|tool_call|>), a request with tools keeps it in
        its text for the parser, as vLLM's skip_special_tokens=False does."""
        ...


def split_with(parser: Parser, text: str) -> tuple[str | None, list[ToolCall]]:
    """Whole text -> the text outside the calls (None when there is none) and the calls, read
    exactly as the format's stream parser reads a stream of it."""
    deltas = parser.feed(text) + parser.finish()
    content = "".join(d.text for d in deltas if d.kind == "content")
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for d in deltas:
        if d.kind == "call":
            names[d.index], arguments[d.index] = d.text, []
        elif d.kind == "arguments":
            arguments[d.index].append(d.text)
    calls = [ToolCall(names[i], "".join(arguments[i])) for i in sorted(names)]
    return (content or None), calls


def held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that begins `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def tag(begin: str, function: Mapping[str, Any], end: str) -> dict[str, Any]:
    """One call's tag: `begin`, the arguments its schema allows, `end`."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "tag",
        "begin": begin,
        "content": {
            "type": "json_schema",
            "json_schema": parameters,
            "max_whitespace_cnt": MAX_WHITESPACE,
        },
        "end": end,
    }


def schemas(structural: Any) -> Iterable[Any]:
    """Every JSON schema inside a structural tag (parsed), for the keyword check."""
    if isinstance(structural, dict):
        if structural.get("type") == "json_schema" and "json_schema" in structural:
            yield structural["json_schema"]
            return
        for value in structural.values():
            yield from schemas(value)
    elif isinstance(structural, list):
        for item in structural:
            yield from schemas(item)


def fold_system(turns: list[dict[str, Any]], template: str | None) -> list[dict[str, Any]]:
    """For a template that refuses a system turn (Gemma 2's "System role not supported"): the
    system text leads the first user turn. For one that wants turns to alternate: consecutive
    turns of one role (tool answers as user turns) joined."""
    text = template or ""
    if "System role not supported" in text and turns and turns[0]["role"] == "system":
        system, rest = turns[0]["content"], turns[1:]
        if rest and rest[0]["role"] == "user":
            rest[0] = {"role": "user", "content": f"{system}\n\n{rest[0]['content']}"}
        else:
            rest.insert(0, {"role": "user", "content": system})
        turns = rest
    if "alternate" not in text:
        return turns
    joined: list[dict[str, Any]] = []
    for turn in turns:
        if joined and joined[-1]["role"] == turn["role"] and set(turn) == {"role", "content"}:
            joined[-1] = {**joined[-1], "content": f"{joined[-1]['content']}\n\n{turn['content']}"}
        else:
            joined.append(turn)
    return joined
