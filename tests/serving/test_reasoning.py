"""Reasoning through the real server on a tiny random Qwen3 checkpoint with Qwen3's own chat
template (tests/fixtures/qwen3_chat_template.jinja) and <think> / </think> tokens: chat
completions' reasoning_content beside content, streamed and whole alike, enable_thinking, the
thinking budget, a JSON schema answer after the thinking; a model that does not think is
unchanged, and a field asking it to think (on any API) is a 400 naming it. A random model never thinks on its own: logit_bias on <think> makes it open a
thinking (and fill it with <think> text), and the budget ends it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serving.test_openai import client
from tests.support import ServerProcess, built_once

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "qwen3_chat_template.jinja"
THINK, END = "<think>", "</think>"


def save_thinking_tokenizer(out: Path, tokenizer_dir: Path) -> None:
    """The default tokenizer with Qwen3's <think> and </think> (added, not special, as Qwen3's)
    and Qwen3's chat template (ChatML, as SmolLM2's)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens([THINK, END], special_tokens=False)
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.save_pretrained(out)


def build_qwen3_thinking(out: Path, tokenizer_dir: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from load.random_gptq import SHAPES, Layout, write_checkpoint

    tokens = out.with_name(out.name + "-tokenizer")
    save_thinking_tokenizer(tokens, tokenizer_dir)
    shape = dataclasses.replace(SHAPES["tiny"], vocab_size=SHAPES["tiny"].vocab_size + 64)
    write_checkpoint(out, shape, Layout(4, 32), tokens, seed=5, family="qwen3")
    # the head's padding rows (no token of the tokenizer) at logit 0, as write_checkpoint puts
    # eos's: far below the top, so the random model does not pick them (the engine samples
    # them where a model favours them: a real model's never do)
    tensors = load_file(out / "model.safetensors")
    tensors["lm_head.weight"][len(AutoTokenizer.from_pretrained(tokens)) :] = 0.0
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def thinking_checkpoint(workdir: Path, tokenizer_dir: Path) -> Path:
    return built_once(
        workdir / "qwen3-thinking-v2", lambda out: build_qwen3_thinking(out, tokenizer_dir)
    )


@pytest.fixture(scope="session")
def qwen3_thinking_dir(workdir: Path, tokenizer_dir: Path) -> Path:
    return thinking_checkpoint(workdir, tokenizer_dir)


@pytest.fixture(scope="module")
def thinker(qwen3_thinking_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess.start(qwen3_thinking_dir, "tiny") as proc:
        yield proc


@pytest.fixture(scope="module")
def think_ids(qwen3_thinking_dir: Path) -> tuple[int, int]:
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(qwen3_thinking_dir).get_vocab()
    return vocab[THINK], vocab[END]


def chat(server: ServerProcess, **body: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Why?"}],
            "temperature": 0} | body  # fmt: skip
    answer = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def stream(server: ServerProcess, **body: Any) -> tuple[str, str, list[dict[str, Any]]]:
    """The streamed reasoning and content, joined, and every delta."""
    body = {"temperature": 0} | body
    completion = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Why?"}], stream=True, **body
    )
    deltas = [c.choices[0].delta.model_dump(exclude_unset=True) for c in completion if c.choices]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    assert reasoning == "".join(d.get("reasoning") or "" for d in deltas)
    return reasoning, "".join(d.get("content") or "" for d in deltas), deltas


def driven(think_ids: tuple[int, int], budget: int = 4, **body: Any) -> dict[str, Any]:
    """A request that surely thinks: <think> favoured, the budget ending the thinking."""
    return {"logit_bias": {str(think_ids[0]): 100}, "thinking_token_budget": budget,
            "max_tokens": 10} | body  # fmt: skip


def test_the_reasoning_is_split_from_the_answer(
    thinker: ServerProcess, think_ids: tuple[int, int]
) -> None:
    message = chat(thinker, **driven(think_ids))["choices"][0]["message"]
    # <think> opens it, 4 thinking tokens (the budget), </think> forced, 4 answer tokens
    assert message["reasoning_content"] == THINK * 4 == message["reasoning"]
    assert message["content"] == THINK * 4


def test_the_stream_carries_the_same_reasoning_and_answer(
    thinker: ServerProcess, think_ids: tuple[int, int]
) -> None:
    body = driven(think_ids, budget=6, max_tokens=12)
    message = chat(thinker, **body)["choices"][0]["message"]
    reasoning, content, deltas = stream(thinker, extra_body=body)
    assert (reasoning, content) == (message["reasoning_content"], message["content"])
    assert any("reasoning_content" in d for d in deltas)


def test_free_thinking_text_splits_the_same_streamed(thinker: ServerProcess) -> None:
    """Sampled text (no bias): whatever the model writes, the stream agrees with the whole."""
    body = {"max_tokens": 24, "temperature": 1.0, "seed": 3}
    message = chat(thinker, **body)["choices"][0]["message"]
    reasoning, content, _ = stream(thinker, **body)
    assert content == message["content"]
    assert reasoning == (message.get("reasoning_content") or "")


def test_enable_thinking_false_gives_no_reasoning(
    thinker: ServerProcess, think_ids: tuple[int, int]
) -> None:
    body = driven(think_ids, chat_template_kwargs={"enable_thinking": False})
    message = chat(thinker, **body)["choices"][0]["message"]
    assert "reasoning_content" not in message and "reasoning" not in message
    assert message["content"] == THINK * 10  # the template closed the thinking: all answer
    reasoning, content, _ = stream(thinker, extra_body=body)
    assert (reasoning, content) == ("", THINK * 10)


def test_the_budget_ends_the_thinking(thinker: ServerProcess, think_ids: tuple[int, int]) -> None:
    for budget in (0, 1, 5):
        message = chat(thinker, **driven(think_ids, budget, max_tokens=12))["choices"][0]
        assert message["message"].get("reasoning_content", "") == THINK * budget
        assert message["message"]["content"] == THINK * (12 - budget - 2)


def test_a_json_schema_answer_parses_after_the_thinking(
    thinker: ServerProcess, think_ids: tuple[int, int]
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    body = driven(
        think_ids, 3, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )  # fmt: skip
    choice = chat(thinker, **body)["choices"][0]
    assert choice["message"]["reasoning_content"] == THINK * 3  # free: the grammar waited
    assert set(json.loads(choice["message"]["content"])) == {"n"}
    assert choice["finish_reason"] == "stop"


def test_a_forced_tool_call_is_read_from_the_answer_after_the_thinking(
    thinker: ServerProcess, think_ids: tuple[int, int]
) -> None:
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
        "required": ["n"], "additionalProperties": False}}}  # fmt: skip
    body = driven(think_ids, 3, max_tokens=80, tools=[tool], tool_choice="required",
                  parallel_tool_calls=False)  # fmt: skip
    choice = chat(thinker, **body)["choices"][0]
    assert choice["message"]["reasoning_content"] == THINK * 3
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["pick"]
    assert set(json.loads(calls[0]["function"]["arguments"])) == {"n"}
    assert choice["finish_reason"] == "tool_calls"


def test_a_bad_template_variable_is_a_400(thinker: ServerProcess) -> None:
    answer = httpx.post(
        f"{thinker.base_url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
              "chat_template_kwargs": {"add_generation_prompt": False}},
        timeout=60,
    )  # fmt: skip
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "chat_template_kwargs"


# (route, body, the field named) asking a model to think: a 400 where it does not
ASKING_THINKING = [
    ("chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("chat/completions", {"chat_template_kwargs": {"enable_thinking": True}},
     "chat_template_kwargs.enable_thinking"),
    ("chat/completions", {"thinking_token_budget": 2}, "thinking_token_budget"),
    ("chat/completions", {"reasoning_effort": "none", "thinking_token_budget": 2},
     "thinking_token_budget"),
    ("responses", {"reasoning": {"effort": "high", "summary": "auto"}}, "reasoning.effort"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ("messages/count_tokens", {"thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking"),
]  # fmt: skip
# and the forms that ask for no thinking, which any model honours
ASKING_NONE = [
    ("chat/completions", {"reasoning_effort": "none"}),
    ("chat/completions", {"reasoning_effort": "minimal"}),
    ("chat/completions", {"chat_template_kwargs": {"enable_thinking": False}}),
    ("chat/completions", {"thinking_token_budget": 0}),
    ("responses", {"reasoning": {"effort": "minimal", "summary": "auto"}}),
    ("responses", {"reasoning": {"effort": "none"}}),
    ("messages", {"thinking": {"type": "disabled"}}),
    ("messages", {"thinking": {"type": "adaptive"}}),
    ("messages/count_tokens", {"thinking": {"type": "disabled"}}),
]  # fmt: skip


def _post(server: ServerProcess, route: str, extra: dict[str, Any]) -> httpx.Response:
    ask = [{"role": "user", "content": "Why?"}]
    body: dict[str, Any] = (
        {"model": "tiny", "input": "Why?", "max_output_tokens": 6}
        if route == "responses"
        else {"model": "tiny", "messages": ask, "max_tokens": 6}
    )
    return httpx.post(f"{server.base_url}/v1/{route}", json=body | extra, timeout=120)


@pytest.mark.parametrize(("route", "extra", "param"), ASKING_THINKING)
def test_a_model_that_does_not_think_refuses_a_field_asking_it_to(
    server: ServerProcess, route: str, extra: dict[str, Any], param: str
) -> None:
    """The default tiny model has no reasoning parser: a field asking it to think cannot be
    honoured, and is a 400 naming it (streamed too: refused before the stream begins)."""
    for stream_too in ({}, {"stream": True}):
        if route == "messages/count_tokens" and stream_too:
            continue
        answer = _post(server, route, extra | stream_too)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert f"'{param}' asks the model to think" in error["message"], error
        if not route.startswith("messages"):  # Anthropic's error body names no param
            assert error["param"] == param


@pytest.mark.parametrize(("route", "extra"), ASKING_NONE)
def test_a_model_that_does_not_think_serves_the_forms_asking_for_none(
    server: ServerProcess, route: str, extra: dict[str, Any]
) -> None:
    answer = _post(server, route, extra)
    assert answer.status_code == 200, answer.text
    text = answer.text
    assert "reasoning_content" not in text and '"thinking"' not in text
    assert '"type":"reasoning"' not in text.replace(" ", "")


def test_a_model_that_does_not_think_is_unchanged(server: ServerProcess) -> None:
    """Without a reasoning field, its answers carry none, whole or streamed."""
    message = chat(server, max_tokens=6)["choices"][0]["message"]
    assert "reasoning_content" not in message and "reasoning" not in message
    _, content, deltas = stream(server, max_tokens=6)
    assert content == message["content"]
    assert not any("reasoning_content" in d for d in deltas)


def test_oip_generate_keeps_the_text_as_generated(
    thinker: ServerProcess, think_ids: tuple[int, int]
) -> None:
    """OIP, V2 and Triton answer the text as before, tags and all: no reasoning field there."""
    answer = httpx.post(
        f"{thinker.base_url}/v2/models/tiny/generate",
        json={"text_input": "Why?", "parameters": {
            "chat": True, "max_tokens": 5, "temperature": 0,
            "logit_bias": {str(think_ids[0]): 100}}},
        timeout=60,
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    assert answer.json()["text_output"] == THINK * 5
