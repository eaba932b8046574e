"""The engine's answer as Anthropic's message and stream: a stream's blocks are the whole
answer's, piece by piece, whatever the cut; stop reasons; usage."""

from __future__ import annotations

import json
from typing import Any

import pytest

from predictor.protocols.anthropic import responses
from predictor.protocols.anthropic.requests import decode_messages
from predictor.types import Completion, FinishReason, TokenEvent, Usage

TOOLS = [
    {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
]
BODY: dict[str, Any] = {
    "model": "m",
    "max_tokens": 9,
    "messages": [{"role": "user", "content": "x"}],
}
CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def accumulate(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Blocks from stream events, as the anthropic SDK accumulates them."""
    blocks: list[dict[str, Any]] = []
    json_text: dict[int, str] = {}
    for name, data in events:
        if name == "content_block_start":
            assert data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            delta = data["delta"]
            if delta["type"] == "text_delta":
                blocks[data["index"]]["text"] += delta["text"]
            else:
                json_text[data["index"]] = json_text.get(data["index"], "") + delta["partial_json"]
    for index, text in json_text.items():
        blocks[index]["input"] = json.loads(text)
    return blocks


@pytest.mark.parametrize(
    ("tools", "text"),
    [
        (False, "plain text, no calls"),
        (True, "some text " + CALL),
        (True, CALL + "\n" + CALL.replace('"a": 1', '"a": 2')),
        (True, CALL + " then text"),
    ],
)
def test_a_stream_is_the_whole_answer_cut_anywhere(tools: bool, text: str) -> None:
    request = decode_messages({**BODY, **({"tools": TOOLS} if tools else {})}, 64)
    whole = responses.message_body(request, Completion("r", text, FinishReason.EOS, Usage(5, 3)))
    for size in (1, 3, 7, len(text)):
        encoder = responses.StreamEncoder(request)
        events = encoder.opening(TokenEvent("r", "", first_usage=Usage(5, 0, 2)))
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            event = TokenEvent(
                "r", piece, finish_reason=FinishReason.EOS if last else None,
                usage=Usage(5, 3) if last else None,
            )  # fmt: skip
            events += encoder.event(event)
        names = [name for name, _ in events]
        assert names[0] == "message_start" and names.count("ping") == 1
        assert names[-2:] == ["message_delta", "message_stop"]
        assert names.count("content_block_start") == names.count("content_block_stop")
        streamed = accumulate(events)
        expected = [{k: v for k, v in b.items() if k != "id"} for b in whole["content"]]
        assert [{k: v for k, v in b.items() if k != "id"} for b in streamed] == expected
        assert events[-2][1]["delta"]["stop_reason"] == whole["stop_reason"]
    assert whole["stop_reason"] == ("tool_use" if tools else "end_turn")


def test_stop_reasons_and_usage() -> None:
    request = decode_messages({**BODY, "stop_sequences": ["zz"]}, 64)
    cut = Completion("r", "ab", FinishReason.LENGTH, Usage(10, 9, 4))
    body = responses.message_body(request, cut)
    assert (body["stop_reason"], body["stop_sequence"]) == ("max_tokens", None)
    assert body["usage"] == {
        "input_tokens": 6, "output_tokens": 9,
        "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4,
    }  # fmt: skip
    stopped = Completion("r", "ab", FinishReason.STOP, Usage(1, 1), stop_sequence="zz")
    body = responses.message_body(request, stopped)
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "zz")
    empty = responses.message_body(request, Completion("r", "", FinishReason.EOS, Usage(1, 1)))
    assert empty["content"] == [] and empty["stop_reason"] == "end_turn"


def test_a_call_cut_by_max_tokens_has_an_empty_input() -> None:
    request = decode_messages({**BODY, "tools": TOOLS}, 64)
    cut = Completion("r", CALL[:40], FinishReason.LENGTH, Usage(1, 9))
    body = responses.message_body(request, cut)
    assert body["stop_reason"] == "max_tokens"
    assert [(b["type"], b["name"], b["input"]) for b in body["content"]] == [("tool_use", "f", {})]
