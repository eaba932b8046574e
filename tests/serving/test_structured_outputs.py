"""Structured outputs through the real server: the `openai` SDK (response_format, vLLM's
structured_outputs), OIP generate, V2 and Triton's sampling_parameters; every output validates."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.engine.test_grammar import SCHEMAS
from tests.serving.test_openai import client
from tests.support import ServerProcess


def schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": strict}}


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_chat_response_format_json_schema_validates(server: ServerProcess, index: int) -> None:
    schema = SCHEMAS[index]
    out = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "JSON please"}], n=3, seed=index,
        temperature=0.8, max_tokens=200, response_format=schema_format(schema),
    )  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_json_schema_streams_and_completions_take_structured_outputs(server: ServerProcess) -> None:
    schema = SCHEMAS[4]
    stream = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], temperature=0.8, seed=3,
        max_tokens=200, response_format=schema_format(schema, strict=False), stream=True,
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    assert chunks[-1].choices[0].finish_reason == "stop"
    out = client(server).completions.create(
        model="tiny", prompt="x", temperature=0.8, max_tokens=200, logprobs=1,
        extra_body={"structured_outputs": {"json": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(out.choices[0].text), schema)
    assert out.choices[0].logprobs is not None


def test_regex_and_choice_on_completions(server: ServerProcess) -> None:
    for seed in range(3):
        out = client(server).completions.create(
            model="tiny", prompt="x", temperature=0.8, seed=seed, max_tokens=30,
            extra_body={"structured_outputs": {"regex": "[a-f]{3}[0-9]{2}"}},
        )  # fmt: skip
        assert re.fullmatch("[a-f]{3}[0-9]{2}", out.choices[0].text)
        out = client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], temperature=0.8,
            seed=seed, max_tokens=30,
            extra_body={"structured_outputs": {"choice": ["left", "right"]}},
        )  # fmt: skip
        assert out.choices[0].message.content in ("left", "right")


def test_json_object_mode_gives_an_object(server: ServerProcess) -> None:
    out = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], temperature=0, max_tokens=300,
        response_format={"type": "json_object"},
    )  # fmt: skip
    choice = out.choices[0]
    if choice.finish_reason == "stop":  # a random model may write a long object
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:
        assert (choice.message.content or "").startswith("{")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": schema_format({"type": "string", "format": "date"})}, "response_format"),
        ({"response_format": schema_format({"not": {"type": "string"}})}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(?=x)y"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "response_format"),
    ],
)  # fmt: skip
def test_what_cannot_be_enforced_is_a_400_naming_it(
    server: ServerProcess, extra: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5,
            extra_body=extra,
        )  # fmt: skip
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]


def test_the_same_key_on_oip_v2_and_triton(server: ServerProcess) -> None:
    schema = SCHEMAS[1]
    so = {"json": schema}
    base = f"{server.base_url}/v2/models/tiny"
    bodies = [
        ("generate", {"text_input": "x", "parameters": {"max_tokens": 200, "temperature": 0.8,
                      "seed": 1, "structured_outputs": so}}),
        ("generate", {"text_input": "x", "max_tokens": 200, "structured_outputs": json.dumps(so)}),
        ("infer", {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                   "data": ["x"]}], "parameters": {"max_tokens": 200,  # V2 parameters are scalars: JSON text
                   "structured_outputs": json.dumps(so)}}),
        ("infer", {"inputs": [
            {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["x"]},
            {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES",
             "data": [json.dumps({"max_tokens": 200, "structured_outputs": so})]}]}),
    ]  # fmt: skip
    for route, body in bodies:
        r = httpx.post(f"{base}/{route}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()
        text = got["text_output"] if route == "generate" else got["outputs"][0]["data"][0]
        jsonschema.validate(json.loads(text), schema)
    bad = {"text_input": "x", "parameters": {"structured_outputs": {"regex": "(?<=a)"}}}
    r = httpx.post(f"{base}/generate", json=bad, timeout=60)
    assert r.status_code == 400 and "structured_outputs" in r.text


def test_logit_bias_through_the_sdk(server: ServerProcess) -> None:
    ids = client(server).completions.create(
        model="tiny", prompt="x", max_tokens=4, temperature=0, logprobs=0
    )
    forced = 42
    out = client(server).completions.create(
        model="tiny", prompt="x", max_tokens=4, temperature=0.9, logit_bias={str(forced): 100},
        extra_body={"return_tokens_as_token_ids": True}, logprobs=0,
    )  # fmt: skip
    assert ids.choices[0].logprobs is not None and out.choices[0].logprobs is not None
    assert out.choices[0].logprobs.tokens == [f"token_id:{forced}"] * 4
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).completions.create(
            model="tiny", prompt="x", max_tokens=4, logit_bias={"99999999": 1}
        )
    assert caught.value.body["param"] == "logit_bias"  # type: ignore[index]


def test_token_id_prompts_and_tokenize_detokenize(server: ServerProcess) -> None:
    text = "Hello there, world"
    for prefix in ("", "/v1"):
        r = httpx.post(
            f"{server.base_url}{prefix}/tokenize", json={"model": "tiny", "prompt": text}
        )
        assert r.status_code == 200, r.text
        ids = r.json()["tokens"]
        assert r.json()["count"] == len(ids) > 0
        r = httpx.post(
            f"{server.base_url}{prefix}/detokenize", json={"model": "tiny", "tokens": ids}
        )
        assert r.status_code == 200 and r.json()["prompt"] == text
    chat = httpx.post(f"{server.base_url}/tokenize", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "return_token_strs": True})  # fmt: skip
    assert chat.status_code == 200 and len(chat.json()["token_strs"]) == chat.json()["count"]
    by_text = client(server).completions.create(
        model="tiny", prompt=text, max_tokens=5, temperature=0
    )
    by_ids = client(server).completions.create(
        model="tiny", prompt=ids, max_tokens=5, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)
    two = client(server).completions.create(model="tiny", prompt=[ids, ids[:2]], max_tokens=3)
    assert len(two.choices) == 2
    for bad in ({"model": "tiny", "tokens": [10**8]}, {"model": "tiny", "tokens": [-1]}):
        r = httpx.post(f"{server.base_url}/detokenize", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("tokens")
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).completions.create(model="tiny", prompt=[10**8], max_tokens=3)
    assert caught.value.body["param"] == "prompt"  # type: ignore[index]
