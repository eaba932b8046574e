"""Reasoning on the Responses and Messages APIs through the real openai and anthropic SDKs, on
the tiny Qwen3 checkpoint of test_reasoning.py served with --reasoning-parser deepseek_r1 (the
output starts inside the thinking: the random model surely thinks) and --reasoning-budget 4
(the server's budget ends it). Each API's reasoning and answer equal chat completions' for the
same greedy request, streamed and whole."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.serving.test_messages_api import GREEDY
from tests.serving.test_messages_api import client as anthropic_client
from tests.serving.test_openai import client
from tests.serving.test_reasoning import chat, thinking_checkpoint
from tests.support import ServerProcess

BUDGET = 4
ASK = "Why?"


@pytest.fixture(scope="module")
def r1(workdir: Path, tokenizer_dir: Path) -> Iterator[ServerProcess]:
    extra = ["--reasoning-parser", "deepseek_r1", "--reasoning-budget", str(BUDGET)]
    path = thinking_checkpoint(workdir, tokenizer_dir)
    with ServerProcess.start(path, "tiny", extra=extra) as proc:
        yield proc


def chat_split(server: ServerProcess, **body: Any) -> tuple[str, str]:
    message = chat(server, max_tokens=12, **body)["choices"][0]["message"]
    return message.get("reasoning_content", ""), message["content"]


def test_the_server_budget_ends_a_thinking_open_from_the_start(r1: ServerProcess) -> None:
    reasoning, content = chat_split(r1)
    assert reasoning and content  # the budget's 4 tokens of thinking, then the answer
    assert chat_split(r1, thinking_token_budget=0)[0] == ""  # a request's own budget wins


def test_responses_give_a_reasoning_item_then_the_message(r1: ServerProcess) -> None:
    reasoning, content = chat_split(r1)
    response = client(r1).responses.create(
        model="tiny", input=ASK, max_output_tokens=12, temperature=0,
        reasoning={"effort": "medium", "summary": "auto"},
    )  # fmt: skip
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    item = response.output[0]
    assert item.type == "reasoning" and item.summary == []
    assert item.content is not None and item.content[0].text == reasoning
    assert response.output_text == content
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens == BUDGET + 1  # and </think>


def test_a_responses_stream_sends_the_reasoning_events(r1: ServerProcess) -> None:
    reasoning, content = chat_split(r1)
    deltas: list[str] = []
    done: list[str] = []
    with client(r1).responses.stream(
        model="tiny", input=ASK, max_output_tokens=12, temperature=0
    ) as stream:
        for event in stream:
            if event.type == "response.reasoning_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.reasoning_text.done":
                done.append(event.text)
        final = stream.get_final_response()
    assert "".join(deltas) == reasoning and done == [reasoning]
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == content


def test_responses_effort_none_turns_the_thinking_off(r1: ServerProcess) -> None:
    response = client(r1).responses.create(
        model="tiny", input=ASK, max_output_tokens=6, temperature=0, reasoning={"effort": "none"}
    )
    assert [item.type for item in response.output] == ["message"]


def test_messages_give_a_thinking_block_then_the_text(r1: ServerProcess) -> None:
    reasoning, content = chat_split(r1)
    message = anthropic_client(r1).messages.create(
        model="tiny", max_tokens=12, messages=[{"role": "user", "content": ASK}], extra_body=GREEDY
    )
    blocks = message.content
    assert [b.type for b in blocks] == ["thinking", "text"]
    assert isinstance(blocks[0], anthropic.types.ThinkingBlock) and blocks[0].thinking == reasoning
    assert isinstance(blocks[1], anthropic.types.TextBlock) and blocks[1].text == content


def test_a_messages_stream_sends_thinking_deltas(r1: ServerProcess) -> None:
    reasoning, content = chat_split(r1, thinking_token_budget=2)
    thoughts: list[str] = []
    with anthropic_client(r1).messages.stream(
        model="tiny", max_tokens=12, messages=[{"role": "user", "content": ASK}],
        thinking={"type": "enabled", "budget_tokens": 2}, extra_body=GREEDY,
    ) as stream:  # fmt: skip
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                thoughts.append(event.delta.thinking)
        final = stream.get_final_message()
    assert "".join(thoughts) == reasoning
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].type == "text" and final.content[1].text == content


def test_messages_thinking_disabled_gives_no_thinking_block(r1: ServerProcess) -> None:
    message = anthropic_client(r1).messages.create(
        model="tiny", max_tokens=6, messages=[{"role": "user", "content": ASK}],
        thinking={"type": "disabled"}, extra_body=GREEDY,
    )  # fmt: skip
    assert [b.type for b in message.content] == ["text"]
