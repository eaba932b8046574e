"""One parameter row works unchanged on every protocol of the real server: repetition_penalty on
OpenAI, OIP generate, V2 infer and Triton's sampling_parameters gives the same greedy text."""

from __future__ import annotations

import json

import httpx

from tests.support import ServerProcess

PROMPT = "Hello"
KEYS = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "repetition_penalty": 100.0}


def openai_tokens(server: ServerProcess, **keys: object) -> tuple[str, list[str]]:
    body = {"model": "tiny", "prompt": PROMPT, "logprobs": 0, "return_tokens_as_token_ids": True,
            **keys}  # fmt: skip
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"]


def v2_text(server: ServerProcess, parameters: dict, *extra: dict) -> str:
    text = {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [PROMPT]}
    body = {"inputs": [text, *extra], "parameters": parameters}
    r = httpx.post(f"{server.base_url}/v2/models/tiny/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["outputs"][0]["data"][0])


def test_repetition_penalty_on_every_protocol(server: ServerProcess) -> None:
    text, tokens = openai_tokens(server, **KEYS)
    assert len(tokens) == 12 and len(set(tokens)) == 12  # so strong that nothing repeats
    generate = httpx.post(
        f"{server.base_url}/v2/models/tiny/generate",
        json={"text_input": PROMPT, "parameters": KEYS},
        timeout=60,
    )
    assert generate.status_code == 200, generate.text
    sampling = {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES",
                "data": [json.dumps(KEYS)]}  # fmt: skip
    assert generate.json()["text_output"] == text
    assert v2_text(server, KEYS) == text
    assert v2_text(server, {}, sampling) == text
    refused = httpx.post(
        f"{server.base_url}/v2/models/tiny/generate",
        json={"text_input": PROMPT, "repetition_penalty": 0},
        timeout=60,
    )
    assert refused.status_code == 400 and "repetition_penalty" in refused.json()["error"]
