"""Completions' echo (the prompt leads the text and the logprobs; max_tokens 0) and vLLM's
prompt_logprobs, over the real server and the `openai` SDK, checked against the GPTQ model's own
forward pass over prompt + completion in this process."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch
from httpx_sse import connect_sse

from predictor.model.loader import LoadedModel
from tests.serving.test_openai import SERVED, _token_ids, chat_prompt_ids, client
from tests.support import ServerProcess

PROMPT = "Hello there, how are you today"
LONG = " ".join(f"w{i}" for i in range(90))  # ~310 tokens than a step's 256: chunked prefill


def forward_logprobs(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """log_softmax at each position of one forward pass over ids: row t scores ids[t + 1]."""
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids])).logits[0].float()  # [S, V]
    return torch.log_softmax(logits, dim=-1)


def close(value: float | None, expected: torch.Tensor) -> bool:
    return value == pytest.approx(expected.item(), rel=SERVED, abs=2e-3)


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{path}", json={"model": "tiny", **body}, timeout=120)


@pytest.mark.parametrize("prompt", [PROMPT, LONG])
def test_echo_logprobs_equal_a_forward_pass(
    server: ServerProcess, tiny_gptq: LoadedModel, prompt: str
) -> None:
    prompt_ids = tiny_gptq.tokenizer.encode(prompt)
    assert prompt == PROMPT or len(prompt_ids) > 256  # the server's --max-step-tokens
    out = client(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    plain = client(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0
    )
    choice = out.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    ids = _token_ids(logprobs.tokens)
    assert ids[: len(prompt_ids)] == prompt_ids and len(ids) == len(prompt_ids) + 4
    assert logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] is None
    expected = forward_logprobs(tiny_gptq, ids)
    for t in range(1, len(ids)):
        assert close(logprobs.token_logprobs[t], expected[t - 1, ids[t]]), t
        top = logprobs.top_logprobs[t]
        assert len(top) == 2
        for key, value in top.items():
            assert close(value, expected[t - 1, _token_ids([key])[0]])
    assert out.usage is not None and out.usage.completion_tokens == 4
    assert out.usage.prompt_tokens == len(prompt_ids)


def test_echo_text_offsets_span_prompt_and_completion(
    server: ServerProcess, tiny_gptq: LoadedModel
) -> None:
    out = client(server).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0, echo=True
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.text_offset
    assert logprobs.top_logprobs is None
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == offsets
    assert "".join(logprobs.tokens) == out.choices[0].text  # ASCII: token texts spell it


def test_echo_with_max_tokens_zero_returns_the_prompt(
    server: ServerProcess, tiny_gptq: LoadedModel
) -> None:
    prompt_ids = tiny_gptq.tokenizer.encode(PROMPT)
    out = client(server).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1
    )
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 0
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == len(prompt_ids)
    expected = forward_logprobs(tiny_gptq, prompt_ids)
    for t in range(1, len(prompt_ids)):
        assert close(choice.logprobs.token_logprobs[t], expected[t - 1, prompt_ids[t]])
    bare = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True)
    assert bare.choices[0].text == PROMPT and bare.choices[0].logprobs is None


def test_max_tokens_zero_without_echo_is_refused(server: ServerProcess) -> None:
    for path, body in (
        ("completions", {"prompt": "x", "max_tokens": 0}),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
    ):
        r = post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_echo_of_token_id_prompts(server: ServerProcess, tiny_gptq: LoadedModel) -> None:
    prompts = [tiny_gptq.tokenizer.encode(PROMPT), tiny_gptq.tokenizer.encode("Once upon")]
    out = client(server).completions.create(
        model="tiny", prompt=prompts, max_tokens=3, temperature=0, echo=True, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    for choice, ids in zip(sorted(out.choices, key=lambda c: c.index), prompts, strict=True):
        assert choice.text.startswith(tiny_gptq.tokenizer.decode(ids))
        assert choice.logprobs is not None and choice.logprobs.tokens
        assert _token_ids(choice.logprobs.tokens)[: len(ids)] == ids


def test_streamed_echo_sends_the_prompt_first(server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1, "echo": True}
    whole = post(server, "completions", body).json()["choices"][0]
    chunks = []
    with (
        httpx.Client(timeout=60) as http,
        connect_sse(
            http, "POST", f"{server.base_url}/v1/completions",
            json={"model": "tiny", "stream": True, **body},
        ) as events,
    ):  # fmt: skip
        for sse in events.iter_sse():
            if sse.data == "[DONE]":
                break
            chunks.append(json.loads(sse.data)["choices"][0])
    assert chunks[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
        streamed = [x for c in chunks if c["logprobs"] for x in c["logprobs"][key]]
        assert streamed == whole["logprobs"][key], key
    zero = {**body, "max_tokens": 0, "stream": True}
    with (
        httpx.Client(timeout=60) as http,
        connect_sse(http, "POST", f"{server.base_url}/v1/completions", json={"model": "tiny", **zero})
        as events,
    ):  # fmt: skip
        datas = [json.loads(s.data) for s in events.iter_sse() if s.data != "[DONE]"]
    assert [d["choices"][0]["text"] for d in datas] == [PROMPT]
    assert datas[0]["choices"][0]["finish_reason"] == "length"


def check_prompt_logprobs(entries: list[Any], ids: list[int], loaded: LoadedModel, k: int) -> None:
    """vLLM's shape: null for the first token, then {token id: {logprob, rank, decoded_token}}
    holding the prompt token and the k most likely there."""
    assert len(entries) == len(ids) and entries[0] is None
    expected = forward_logprobs(loaded, ids)
    for t in range(1, len(ids)):
        entry = entries[t]
        assert str(ids[t]) in entry and k <= len(entry) <= k + 1
        for key, value in entry.items():
            assert set(value) == {"logprob", "rank", "decoded_token"}
            assert close(value["logprob"], expected[t - 1, int(key)])
            assert isinstance(value["rank"], int) and value["rank"] >= 1
        mine = entry[str(ids[t])]
        assert mine["decoded_token"] == loaded.tokenizer.decode([ids[t]])
        # the rank within what the logprob tolerance allows: near-tied tokens may swap
        mine_lp = expected[t - 1, ids[t]]
        tol = SERVED * abs(float(mine_lp)) + 2e-3
        assert int((expected[t - 1] > mine_lp + tol).sum()) + 1 <= mine["rank"]
        assert mine["rank"] <= int((expected[t - 1] > mine_lp - tol).sum()) + 1


def test_prompt_logprobs_on_completions_and_chat(
    server: ServerProcess, tiny_gptq: LoadedModel
) -> None:
    r = post(server, "completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert not choice["text"].startswith(PROMPT)  # no echo
    check_prompt_logprobs(
        choice["prompt_logprobs"], tiny_gptq.tokenizer.encode(PROMPT), tiny_gptq, 3
    )
    messages = [{"role": "user", "content": "Hi there"}]
    r = post(
        server, "chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 0}
    )
    assert r.status_code == 200, r.text
    check_prompt_logprobs(
        r.json()["prompt_logprobs"], chat_prompt_ids(tiny_gptq, messages), tiny_gptq, 0
    )
    plain = post(server, "completions", {"prompt": PROMPT, "max_tokens": 2}).json()
    assert "prompt_logprobs" not in plain["choices"][0]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": "3"}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"echo": "yes"}, "echo"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ],
)
def test_bad_echo_and_prompt_logprobs_values_name_the_param(
    server: ServerProcess, change: dict[str, Any], param: str
) -> None:
    r = post(server, "completions", {"prompt": "x", **change})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
