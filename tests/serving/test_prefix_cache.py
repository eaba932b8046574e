"""Prefix caching through the real server: cached tokens in OpenAI usage and OIP details, salts
over every protocol, and the counters on /metrics."""

from __future__ import annotations

import uuid

import httpx
import openai

from tests.support import ServerProcess


def document() -> str:
    """A prompt no other test sends (the server is shared), many blocks long."""
    return f"Document {uuid.uuid4().hex}: " + "the quick brown fox jumps over the lazy dog. " * 12


def metric(server: ServerProcess, name: str) -> float:
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not on /metrics")


def cached_tokens(out: openai.types.Completion) -> int:
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return cached


def test_openai_usage_reports_cached_tokens_and_salts_isolate(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    doc = document()
    hits_before = metric(server, "predictor_prefix_cache_hits_total")

    def ask(question: str, salt: str | None = None) -> openai.types.Completion:
        extra = {"cache_salt": salt} if salt is not None else None
        return client.completions.create(
            model="tiny", prompt=doc + question, max_tokens=3, temperature=0, extra_body=extra
        )

    cold = ask("First question?")
    warm = ask("Second question?")
    salted = ask("Second question?", salt="tenant-a")
    salted_again = ask("Third question?", salt="tenant-a")
    assert cached_tokens(cold) == 0
    assert cached_tokens(warm) > 0.8 * cold.usage.prompt_tokens  # type: ignore[union-attr]
    assert cached_tokens(salted) == 0  # another salt: nothing shared with the unsalted pool
    assert cached_tokens(salted_again) == cached_tokens(warm)  # the salt's own pool
    gained = metric(server, "predictor_prefix_cache_hits_total") - hits_before
    assert gained >= cached_tokens(warm) + cached_tokens(salted_again)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": doc}], max_tokens=2,
        extra_body={"cache_salt": "tenant-b"},
    )  # fmt: skip
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    bad = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "tiny", "prompt": "x", "cache_salt": ""},
        timeout=30,
    )
    assert bad.status_code == 400 and "cache_salt" in bad.text


def test_oip_and_v2_report_cached_tokens(server: ServerProcess) -> None:
    doc = document()

    def generate(salt: str | None) -> dict:
        params: dict = {"max_tokens": 2}
        if salt is not None:
            params["cache_salt"] = salt
        body = {"text_input": doc, "parameters": params}
        r = httpx.post(f"{server.base_url}/v2/models/tiny/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["details"]

    assert generate("s1")["cached_tokens"] == 0
    second = generate("s1")
    assert second["cached_tokens"] > 0.8 * second["prompt_tokens"]
    assert generate("s2")["cached_tokens"] == 0
    infer = {
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [doc]}],
        "parameters": {"max_tokens": 2, "cache_salt": "s2"},
    }
    r = httpx.post(f"{server.base_url}/v2/models/tiny/infer", json=infer, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["parameters"]["cached_tokens"] == second["cached_tokens"]


def test_metrics_describe_the_cache(server: ServerProcess) -> None:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert 'predictor_cache_config_info{block_size="16",enable_prefix_caching="True"' in text
    assert "predictor_prefix_cache_queries_total" in text
    assert "predictor_num_preemptions_total" in text
