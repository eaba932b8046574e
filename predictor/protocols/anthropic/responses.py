"""The engine's answer -> Anthropic's message, its stream events and its error body.

A text is cut into content blocks by one `ContentBuilder`, streamed or whole, so a stream's
blocks are the whole answer's: without tools, one text block; with tools, the engine's call
parser (`engine/tool_formats/`, the model's format) splits it into text blocks and `tool_use`
blocks in the order written, a call's input streamed as `input_json_delta` pieces. Usage says
the prompt as Anthropic does: `input_tokens` computed, `cache_read_input_tokens` served from the
prefix cache (their sum is count_tokens' answer), `cache_creation_input_tokens` 0.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from predictor.engine import tool_formats
from predictor.protocols.anthropic.requests import MessagesRequest
from predictor.types import Completion, FinishReason, TokenEvent, Usage

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
Event = tuple[str, dict[str, Any]]  # (SSE event name, its data)


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(reason: FinishReason, called: bool) -> StopReason:
    """A token cap or deadline is max_tokens; an answer that made calls tool_use; a stop string
    stop_sequence; the end of the model's turn (or of a grammar) end_turn."""
    if reason in (FinishReason.LENGTH, FinishReason.TIMEOUT):
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if reason is FinishReason.STOP else "end_turn"


def usage_body(usage: Usage) -> dict[str, int]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.generated_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def error_body(kind: str, message: str) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}` (also the event that ends a stream)."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def count_body(tokens: int) -> dict[str, int]:
    return {"input_tokens": tokens}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's input; a call cut short by max_tokens (its JSON unfinished) has {}."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class ContentBuilder:
    """Text as it comes -> content block events (start, delta, stop), and the blocks whole."""

    def __init__(self, tool_format: str | None) -> None:
        """`tool_format`: the format calls are read in; None: the text is not read for calls."""
        self._parser = None if tool_format is None else tool_formats.get(tool_format).parser()
        self.blocks: list[dict[str, Any]] = []
        self._arguments: list[str] = []  # per block: a tool_use block's input text so far
        self._open = False
        self.called = False

    def think(self, text: str) -> list[Event]:
        """A thinking model's reasoning: a thinking block (before the answer's), its
        thinking_delta events. No signature is made: the block's is empty."""
        if not text:
            return []
        out: list[Event] = []
        if not self._open or self.blocks[-1]["type"] != "thinking":
            out += self._start({"type": "thinking", "thinking": "", "signature": ""})
        self.blocks[-1]["thinking"] += text
        out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return out

    def feed(self, text: str, final: bool) -> list[Event]:
        if self._parser is None:
            pieces = [tool_formats.Delta("content", text)] if text else []
        else:
            pieces = self._parser.feed(text) + (self._parser.finish() if final else [])
        out: list[Event] = []
        for piece in pieces:
            if piece.kind == "content" and piece.text:
                if not self._open or self.blocks[-1]["type"] != "text":
                    out += self._start({"type": "text", "text": ""})
                self.blocks[-1]["text"] += piece.text
                out.append(self._delta({"type": "text_delta", "text": piece.text}))
            elif piece.kind == "call":
                self.called = True
                out += self._start(
                    {"type": "tool_use", "id": tool_use_id(), "name": piece.text, "input": {}}
                )
            elif piece.kind == "arguments" and piece.text:
                self._arguments[-1] += piece.text
                out.append(self._delta({"type": "input_json_delta", "partial_json": piece.text}))
        if final:
            out += self._stop()
        return out

    def _start(self, block: dict[str, Any]) -> list[Event]:
        out = self._stop()
        self.blocks.append(block)
        self._arguments.append("")
        self._open = True
        index = len(self.blocks) - 1
        start = {"type": "content_block_start", "index": index, "content_block": dict(block)}
        return [*out, ("content_block_start", start)]

    def _delta(self, delta: dict[str, Any]) -> Event:
        index = len(self.blocks) - 1
        body = {"type": "content_block_delta", "index": index, "delta": delta}
        return "content_block_delta", body

    def _stop(self) -> list[Event]:
        if not self._open:
            return []
        self._open = False
        index = len(self.blocks) - 1
        if self.blocks[index]["type"] == "tool_use":
            self.blocks[index]["input"] = tool_input(self._arguments[index])
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]


def _message(
    request: MessagesRequest, content: list[dict[str, Any]], usage: Usage
) -> dict[str, Any]:
    return {
        "id": request.id,
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage_body(usage),
    }


def message_body(request: MessagesRequest, completion: Completion) -> dict[str, Any]:
    """The whole answer."""
    builder = ContentBuilder(request.request.tool_format if request.tools else None)
    builder.think(completion.reasoning)
    builder.feed(completion.text, final=True)
    body = _message(request, builder.blocks, completion.usage)
    body["stop_reason"] = reason = stop_reason(completion.finish_reason, builder.called)
    body["stop_sequence"] = completion.stop_sequence if reason == "stop_sequence" else None
    return body


class StreamEncoder:
    """One request's SSE events: message_start, the content blocks' events (a ping after the
    first block starts), message_delta (stop_reason, usage), message_stop."""

    def __init__(self, request: MessagesRequest) -> None:
        self.request = request
        self._builder = ContentBuilder(request.request.tool_format if request.tools else None)
        self._pinged = False

    def opening(self, first: TokenEvent) -> list[Event]:
        usage = first.usage or first.first_usage or Usage(0, 0)
        message = _message(self.request, [], Usage(usage.prompt_tokens, 0, usage.cached_tokens))
        return [("message_start", {"type": "message_start", "message": message})]

    def event(self, event: TokenEvent) -> list[Event]:
        out = self._builder.think(event.reasoning) + self._builder.feed(event.text, event.final)
        if not self._pinged and (out or event.final):
            self._pinged = True
            at = 1 if out and out[0][0] == "content_block_start" else 0
            out.insert(at, ("ping", {"type": "ping"}))
        if event.final:
            assert event.finish_reason is not None
            reason = stop_reason(event.finish_reason, self._builder.called)
            sequence = event.stop_sequence if reason == "stop_sequence" else None
            delta = {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage_body(event.usage or Usage(0, 0)),
            }
            out += [("message_delta", delta), ("message_stop", {"type": "message_stop"})]
        return out
