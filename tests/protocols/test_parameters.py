"""The parameter table: one row per key, one validator, the same meaning on every protocol."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

import pytest
from kserve import InferInput, InferRequest

from predictor.errors import InvalidRequest
from predictor.protocols import generate, parameters, schemas
from predictor.protocols.limits import Limits
from predictor.protocols.openai.requests import decode_chat, decode_completion
from predictor.protocols.triton.requests import decode_infer_request
from predictor.types import Grammar, SamplingParams

LIMITS = Limits(default_max_tokens=16, max_json_depth=32)


def v2(parameters: dict[str, Any] | None = None, *extra: InferInput) -> InferRequest:
    text = InferInput(name="text_input", shape=[1], datatype="BYTES", data=["hi"])
    return InferRequest("m", [text, *extra], "r", parameters=parameters)


def sampling_tensor(values: dict[str, Any]) -> InferInput:
    return InferInput(
        name="sampling_parameters", shape=[1], datatype="BYTES", data=[json.dumps(values)]
    )


def every_protocol(values: dict[str, Any]) -> list[SamplingParams]:
    """The same keys sent on OIP generate, V2 parameters, Triton sampling_parameters, OpenAI."""
    oip, _ = generate.decode_generate_request({"text_input": "hi", **values}, LIMITS, False)
    infer = decode_infer_request(v2(values), LIMITS, False)
    triton = decode_infer_request(v2(None, sampling_tensor(values)), LIMITS, False)
    openai = decode_completion({"model": "m", "prompt": "hi", **values}, LIMITS.default_max_tokens)
    return [oip.params, infer.requests[0].params, triton.requests[0].params,
            openai.choices[0].params]  # fmt: skip


def test_every_sampling_row_is_a_sampling_field_and_back() -> None:
    rows = {row.field or row.name for row in parameters.TABLE if row.sampling}
    fields_ = {f.name for f in fields(SamplingParams)} - {"logprobs"}  # OpenAI's own shapes
    assert rows == fields_


def test_repetition_penalty_is_one_row_read_alike_everywhere() -> None:
    got = every_protocol({"repetition_penalty": 1.3, "max_tokens": 5})
    assert {p.repetition_penalty for p in got} == {1.3}
    assert all(p.penalized and p.max_tokens == 5 for p in got)
    for bad in (0, -1.0, "x", True):
        for decode in (
            lambda v: generate.decode_generate_request(
                {"text_input": "hi", "repetition_penalty": v}, LIMITS, False
            ),
            lambda v: decode_chat(
                {
                    "model": "m",
                    "messages": [{"role": "user", "content": "x"}],
                    "repetition_penalty": v,
                },
                16,
            ),  # fmt: skip
        ):
            with pytest.raises(InvalidRequest, match="repetition_penalty") as info:
                decode(bad)
            assert info.value.param == "repetition_penalty"


def test_defaults_differ_only_where_the_table_says() -> None:
    oip, infer, triton, openai = every_protocol({})
    assert oip == infer == triton
    assert oip.temperature == 0.0 and openai.temperature == 1.0  # OpenAI's default
    assert openai == SamplingParams(max_tokens=16, temperature=1.0)


def test_aliases_are_oip_only_and_a_conflict_is_ambiguous() -> None:
    request = decode_infer_request(v2({"random_seed": 5, "min_length": 2}), LIMITS, False)
    assert request.requests[0].params.seed == 5 and request.requests[0].params.min_tokens == 2
    with pytest.raises(InvalidRequest, match="ambiguous"):
        decode_infer_request(v2({"seed": 4, "random_seed": 5}), LIMITS, False)
    with pytest.raises(InvalidRequest, match="random_seed"):
        decode_completion({"model": "m", "prompt": "hi", "random_seed": 5}, 16)


def test_the_openapi_bodies_come_from_the_table() -> None:
    for row in parameters.rows("generate"):
        assert row.name in schemas.GENERATE_REQUEST_SCHEMA["properties"]
        assert row.name in schemas.INFER_REQUEST_SCHEMA["properties"]["parameters"]["properties"]
    for row in parameters.rows("openai"):
        assert row.name in schemas.COMPLETION_SCHEMA["properties"]
        assert row.name in schemas.CHAT_SCHEMA["properties"]
    penalty = schemas.GENERATE_REQUEST_SCHEMA["properties"]["repetition_penalty"]
    assert penalty == {"type": "number", "exclusiveMinimum": 0}
    assert schemas.CHAT_SCHEMA["properties"]["temperature"]["maximum"] == 2


def test_decoders_leave_the_body_walk_to_the_edge() -> None:
    # once, the codecs walked every generate body again with a fixed depth of 32, so raising
    # --max-json-depth at the edge still refused deeper bodies: the decoder now trusts the edge
    deep: Any = "x"
    for _ in range(40):
        deep = [deep]
    request, _ = generate.decode_generate_request(
        {"text_input": "hi", "parameters": {"client_field": deep}}, Limits(16, 64), False
    )
    assert request.prompt == "hi"


def test_json_the_decoders_parse_themselves_uses_the_limit_passed_in() -> None:
    body = sampling_tensor({"stop": ["a"]})  # nested two deep
    decode_infer_request(v2(None, body), Limits(16, 2), False)
    with pytest.raises(InvalidRequest, match="deeper than 1"):
        decode_infer_request(v2(None, sampling_tensor({"stop": ["a"]})), Limits(16, 1), False)
    stop = json.dumps([["a"]])  # a stop list in a string (gRPC), one level too deep
    with pytest.raises(InvalidRequest, match="deeper than 1"):
        decode_infer_request(v2({"stop": stop}), Limits(16, 1), False)


def test_structured_outputs_is_one_row_read_alike_everywhere() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for so in ({"json": schema}, json.dumps({"json": schema})):
        got = every_protocol({"structured_outputs": so})
        assert {p.grammar for p in got} == {Grammar("json_schema", json.dumps(schema))}
    got = every_protocol({"structured_outputs": {"choice": ["a", "b"]}})
    assert {p.grammar for p in got} == {Grammar("choice", '["a", "b"]')}
    regex = every_protocol({"structured_outputs": {"regex": "[0-9]+"}})
    assert {p.grammar for p in regex} == {Grammar("regex", "[0-9]+")}


def test_response_format_is_openai_s_and_means_the_same() -> None:
    schema = {"type": "array"}
    body = {"model": "m", "prompt": "hi"}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    got = decode_completion({**body, "response_format": fmt}, 16).choices[0].params.grammar
    assert got == Grammar("json_schema", json.dumps(schema), "response_format")
    text = decode_completion({**body, "response_format": {"type": "text"}}, 16)
    assert text.choices[0].params.grammar is None
    with pytest.raises(InvalidRequest) as info:
        generate.decode_generate_request(
            {"text_input": "hi", "response_format": {"type": "json_object"}}, LIMITS, False
        )
    assert "response_format" in str(info.value)
    for bad, param in (
        ({"structured_outputs": {"json_object": True, "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        ({"structured_outputs": "{not json"}, "structured_outputs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "x": 1}}},
         "response_format.json_schema.x"),
    ):  # fmt: skip
        with pytest.raises(InvalidRequest) as info:
            decode_completion({**body, **bad}, 16)
        assert info.value.param == param


def test_logit_bias_is_one_row_read_alike_everywhere() -> None:
    for bias in ({"5": 10, "3": -100}, json.dumps({"5": 10, "3": -100})):
        got = every_protocol({"logit_bias": bias})
        assert {p.logit_bias for p in got} == {((3, -100.0), (5, 10.0))}
        assert all(p.penalized for p in got)
    for bad in ({"x": 1}, {"5": 101}, {"5": "1"}, [1]):
        with pytest.raises(InvalidRequest) as info:
            decode_completion({"model": "m", "prompt": "hi", "logit_bias": bad}, 16)
        assert info.value.param == "logit_bias"
