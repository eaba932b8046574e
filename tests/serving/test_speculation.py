"""Speculative decoding through the real server: the drafts' acceptance in OpenAI usage and OIP
details, the per-request opt-out, the same text with and without, vLLM's counters on /metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion

from tests.support import ServerProcess

T = TypeVar("T")


@pytest.fixture(scope="module")
def speculating(tiny_gptq_dir: Path) -> Iterator[ServerProcess]:
    extra = ["--speculative", "suffix", "--num-speculative-tokens", "4", "--vllm-metric-aliases",
             "true"]  # fmt: skip
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as proc:
        yield proc


def metrics(server: ServerProcess) -> dict[str, float]:
    found = {}
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(("predictor_spec_decode", "vllm:spec_decode")):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def generate(server: ServerProcess, prompt: str, **parameters: object) -> dict:
    body = {"text_input": prompt, "parameters": {"max_tokens": 40, **parameters}}
    r = httpx.post(f"{server.base_url}/v2/models/tiny/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def until_drafted(send: Callable[[], T], drafted: Callable[[T], bool]) -> list[T]:
    """Send one request until a send has drafts accepted: the server drafts only while the
    steps it has timed say drafts pay, and a machine busy with other tests can time them so
    they do not; the policy still tries a draft once in 64 declined offers, and a repeat
    offers a draft every step (its own earlier answer, which greedy decoding accepts), so a
    few sends always have some."""
    sent = [send()]
    while not drafted(sent[-1]) and len(sent) < 8:
        sent.append(send())
    assert drafted(sent[-1]), f"no drafts in {len(sent)} sends"
    return sent


def test_drafts_are_counted_and_change_no_text(speculating: ServerProcess) -> None:
    before = metrics(speculating)
    sent = until_drafted(lambda: generate(speculating, "Repeat after me: one two three"),
                         lambda out: out["details"]["accepted_draft_tokens"] > 0)  # fmt: skip
    plain = generate(speculating, "Repeat after me: one two three", speculative=False)
    assert {out["text_output"] for out in sent} == {plain["text_output"]}
    details = sent[-1]["details"]
    assert details["generated_tokens"] == 40
    assert 0 < details["accepted_draft_tokens"] <= details["draft_tokens"]
    assert plain["details"]["draft_tokens"] == 0 == plain["details"]["accepted_draft_tokens"]
    after = metrics(speculating)
    accepted = 'predictor_spec_decode_num_accepted_tokens_total{model="tiny"}'
    counted = sum(out["details"]["accepted_draft_tokens"] for out in sent)
    assert after[accepted] - before.get(accepted, 0.0) == counted
    alias = 'vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"}'
    assert after[alias] == after[accepted]
    first = 'predictor_spec_decode_num_accepted_tokens_per_pos_total{model="tiny",position="0"}'
    assert after[first] > 0


def test_openai_usage_counts_the_drafts_as_predicted_tokens(speculating: ServerProcess) -> None:
    client = openai.OpenAI(base_url=speculating.base_url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Say hello again and again"}]

    def send() -> ChatCompletion:
        return client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                              max_tokens=30, temperature=0)  # fmt: skip

    def accepted(out: ChatCompletion) -> bool:
        details = out.usage.completion_tokens_details if out.usage else None
        return details is not None and bool(details.accepted_prediction_tokens)

    out = until_drafted(send, accepted)[-1]
    usage = out.usage
    assert usage is not None and usage.completion_tokens == 30
    details = usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens
    assert details.rejected_prediction_tokens is not None
    off = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                         max_tokens=30, temperature=0,
                                         extra_body={"speculative": False})  # fmt: skip
    assert off.choices[0].message.content == out.choices[0].message.content
    assert off.usage is not None and off.usage.completion_tokens_details is None


def test_a_speculative_field_that_is_not_a_boolean_is_refused(speculating: ServerProcess) -> None:
    body = {"text_input": "Hi", "parameters": {"max_tokens": 4, "speculative": "sometimes"}}
    r = httpx.post(f"{speculating.base_url}/v2/models/tiny/generate", json=body, timeout=30)
    assert r.status_code == 400 and "speculative" in r.json()["error"]
