"""Chat answers with tools, as the encoders write them: the text a model writes when `auto`
lets it call (a random-weight model never begins a call by itself, so the served tests force
theirs), whole and streamed in pieces, as the openai SDK reads them."""

from __future__ import annotations

import json

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from predictor.engine.tool_calls import call_text
from predictor.protocols.openai import responses
from predictor.protocols.openai.requests import decode_chat
from predictor.types import Completion, FinishReason, TokenEvent, Usage

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
BODY = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
TEXT = (
    "Let me look that up.\n"
    + call_text("get_weather", {"city": "Paris"})
    + "\n"
    + call_text("get_weather", {"city": "Rome"})
)


def test_an_auto_answer_with_calls_is_message_tool_calls() -> None:
    request = decode_chat(BODY, 64)
    assert request.tools
    done = Completion("r", TEXT, FinishReason.EOS, Usage(5, 40))
    body = ChatCompletion.model_validate_json(responses.chat_response(request, [done]))
    (choice,) = body.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look that up."
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})
    ]  # fmt: skip
    assert len({c.id for c in calls}) == 2


def test_a_streamed_auto_answer_gives_content_then_call_deltas() -> None:
    request = decode_chat(BODY | {"stream": True}, 64)
    encoder = responses.ChunkEncoder(request)
    pieces = [TEXT[i : i + 3] for i in range(0, len(TEXT), 3)]
    events = [TokenEvent("r", p, (1,)) for p in pieces[:-1]]
    events.append(TokenEvent("r", pieces[-1], (1,), FinishReason.EOS, Usage(5, 40)))
    chunks = [
        ChatCompletionChunk.model_validate_json(c)
        for c in [*encoder.opening(), *(encoder.event(0, e) for e in events)]
        if c is not None
    ]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == "Let me look that up."
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for piece in c.choices[0].delta.tool_calls or []:
            assert piece.function is not None
            if piece.id is not None:
                calls[piece.index] = [piece.function.name or "", ""]
            calls[piece.index][1] += piece.function.arguments or ""
    assert [(n, json.loads(a)) for n, a in calls.values()] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})
    ]  # fmt: skip
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_without_a_call_auto_is_a_plain_answer_and_none_reads_nothing() -> None:
    for body in (BODY, BODY | {"tool_choice": "none"}):
        request = decode_chat(body, 64)
        text = "Sunny." if body is BODY else TEXT
        done = Completion("r", text, FinishReason.EOS, Usage(5, 3))
        (choice,) = ChatCompletion.model_validate_json(
            responses.chat_response(request, [done])
        ).choices
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None
        assert choice.message.content == text
