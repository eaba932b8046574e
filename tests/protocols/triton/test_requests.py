"""V2 requests with Triton's conventions (vLLM / TensorRT-LLM input tensors) and the responses."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kserve import InferInput, InferRequest
from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb
from kserve.protocol.infer_type import RequestedOutput, deserialize_bytes_tensor

from predictor.errors import InvalidRequest
from predictor.protocols.limits import Limits
from predictor.protocols.triton import requests as v2_requests
from predictor.protocols.triton import responses as triton_responses
from predictor.protocols.triton import tensors as triton_tensors
from predictor.types import Completion, FinishReason, TokenEvent, Usage
from tests.protocols.test_generate import accepted_is_clean, any_text

LIMITS = Limits(default_max_tokens=64, max_json_depth=32)


# -- V2 tensors ---------------------------------------------------------------------------------


def tensor(name: str, datatype: str, values: list[Any]) -> InferInput:
    return InferInput(name=name, shape=[len(values)], datatype=datatype, data=values)


def v2(*extra: InferInput, parameters: dict[str, Any] | None = None,
       outputs: list[str] | None = None) -> InferRequest:  # fmt: skip
    inputs = [tensor("text_input", "BYTES", ["Hello"]), *extra]
    request = InferRequest("m", inputs, "r", parameters=parameters)
    if outputs:
        request.request_outputs = [RequestedOutput(name=o) for o in outputs]
    return request


def sampling(params: dict[str, Any]) -> InferInput:
    return tensor("sampling_parameters", "BYTES", [json.dumps(params)])


def decode(request: InferRequest, streaming: bool = False) -> v2_requests.V2Request:
    return v2_requests.decode_infer_request(request, LIMITS, streaming)


def test_vllm_sampling_parameters_with_string_values() -> None:
    # the vLLM backend's sample client sends strings, and the same dict as request parameters
    params = {"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}
    decoded = decode(v2(sampling(params), parameters=params))
    p = decoded.requests[0].params
    assert (p.temperature, p.top_p, p.max_tokens) == (0.1, 0.95, 100)
    assert decoded.outputs == ("text_output",) and not decoded.stream


def test_vllm_stream_and_exclude_input() -> None:
    false, true = (tensor(n, "BOOL", [v]) for n, v in (("stream", False), ("stream", True)))
    # stream false: the whole text, led by the prompt unless exclude_input_in_output is true
    assert decode(v2(false)).include_prompt is True
    assert (
        decode(v2(false, tensor("exclude_input_in_output", "BOOL", [True]))).include_prompt is False
    )
    assert decode(v2(false), streaming=True).stream is False
    # no stream tensor: each route's own way, no prompt
    assert decode(v2()).include_prompt is False and decode(v2(), streaming=True).stream is True
    assert decode(v2(true), streaming=True).stream is True
    with pytest.raises(InvalidRequest, match="infer_stream"):
        decode(v2(true))
    with pytest.raises(InvalidRequest, match="exclude_input_in_output"):
        decode(v2(true, tensor("exclude_input_in_output", "BOOL", [False])), streaming=True)


def test_tensorrt_llm_scalar_tensors() -> None:
    decoded = decode(
        v2(
            tensor("max_tokens", "INT32", [9]),
            tensor("temperature", "FP32", [0.5]),
            tensor("random_seed", "UINT64", [11]),
            tensor("min_length", "INT32", [2]),
            tensor("stop_words", "BYTES", ["", "END"]),
        )
    )
    p = decoded.requests[0].params
    assert (p.max_tokens, p.temperature, p.seed, p.min_tokens, p.stop) == (9, 0.5, 11, 2, ("END",))


def test_scalar_tensors_over_grpc_raw_contents() -> None:
    msg = pb.ModelInferRequest(model_name="m", id="g")
    for name, datatype, raw in [
        ("text_input", "BYTES", b"\x02\x00\x00\x00hi"),
        ("max_tokens", "INT32", np.array([5], dtype=np.int32).tobytes()),
        ("stream", "BOOL", np.array([False]).tobytes()),
        ("return_num_output_tokens", "BOOL", np.array([True]).tobytes()),
    ]:
        msg.inputs.add(name=name, datatype=datatype, shape=[1])
        msg.raw_input_contents.append(raw)
    decoded = decode(InferRequest.from_grpc(msg), streaming=True)
    assert decoded.requests[0].params.max_tokens == 5 and decoded.stream is False
    assert decoded.outputs == ("text_output", "num_output_tokens")


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (v2(tensor("image", "BYTES", ["x"])), "unexpected inference input 'image'"),
        (v2(tensor("max_tokens", "FP32", [1.5])), "max_tokens"),
        (v2(tensor("max_tokens", "INT32", [1, 2])), "one value"),
        (v2(tensor("stream", "INT32", [1])), "BOOL"),
        (v2(sampling({"n": 2})), "'n' in input 'sampling_parameters'"),
        (v2(tensor("sampling_parameters", "BYTES", ["{"])), "not valid JSON"),
        (v2(sampling({"max_tokens": 5}), parameters={"max_tokens": 6}), "ambiguous"),
        (v2(sampling({"max_tokens": 5}), tensor("max_tokens", "INT32", [6])), "ambiguous"),
        (v2(tensor("seed", "UINT64", [1]), tensor("random_seed", "UINT64", [2])), "ambiguous"),
        (v2(outputs=["logits"]), "unexpected inference output 'logits'"),
        (v2(tensor("text_input", "BYTES", ["again"])), "given twice"),
    ],
)
def test_v2_refusals_name_what_is_wrong(request_: InferRequest, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        decode(request_)


def test_equal_values_in_two_places_are_fine() -> None:
    decoded = decode(v2(sampling({"max_tokens": 5}), tensor("max_tokens", "INT32", [5]),
                        parameters={"max_tokens": "5", "own_key": "kept"}))  # fmt: skip
    assert decoded.requests[0].params.max_tokens == 5


# -- responses ----------------------------------------------------------------------------------


def flags(*names: str) -> list[InferInput]:
    return [tensor(f"return_{n}", "BOOL", [True]) for n in names]


def test_unary_response_with_optional_outputs_over_rest() -> None:
    request = v2(tensor("stream", "BOOL", [False]),
                 *flags("finish_reason", "num_input_tokens", "num_output_tokens"))  # fmt: skip
    decoded = decode(request)
    completion = Completion("r", " world", FinishReason.EOS, Usage(3, 2))
    body, _ = triton_responses.encode_infer_response(request, "m", decoded, [completion]).to_rest()
    assert isinstance(body, dict)
    outputs = {o["name"]: o["data"] for o in body["outputs"]}
    assert outputs == {
        "text_output": ["Hello world"],  # stream false: the prompt leads, as the vLLM backend does
        "finish_reason": ["stop"],
        "num_input_tokens": [3],
        "num_output_tokens": [2],
    }


def test_stream_responses_over_grpc_carry_raw_outputs() -> None:
    msg = pb.ModelInferRequest(model_name="m", id="g")
    msg.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    msg.raw_input_contents.append(b"\x02\x00\x00\x00hi")
    for name in ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens"):
        msg.inputs.add(name=name, datatype="BOOL", shape=[1])
        msg.raw_input_contents.append(np.array([True]).tobytes())
    request = InferRequest.from_grpc(msg)
    decoded = decode(request, streaming=True)
    middle = TokenEvent("g", "ab", (1, 2))
    last = TokenEvent("g", "c", (3,), FinishReason.LENGTH, Usage(4, 3))
    grpc_middle = triton_responses.encode_stream_response(request, "m", decoded, middle).to_grpc()
    grpc_last = triton_responses.encode_stream_response(request, "m", decoded, last).to_grpc()
    assert [o.name for o in grpc_middle.outputs] == ["text_output", "finish_reason",
                                                     "num_output_tokens"]  # fmt: skip
    assert deserialize_bytes_tensor(grpc_middle.raw_output_contents[1]).tolist() == [b"None"]
    assert np.frombuffer(grpc_middle.raw_output_contents[2], np.uint32).tolist() == [2]
    assert [o.name for o in grpc_last.outputs] == ["text_output", "finish_reason",
                                                   "num_input_tokens", "num_output_tokens"]  # fmt: skip
    assert deserialize_bytes_tensor(grpc_last.raw_output_contents[1]).tolist() == [b"length"]
    assert np.frombuffer(grpc_last.raw_output_contents[2], np.uint32).tolist() == [4]
    assert triton_responses.wants_every_token(decoded)


def test_whole_event_counts_every_token() -> None:
    request = v2(tensor("stream", "BOOL", [False]), *flags("num_output_tokens"))
    decoded = decode(request, streaming=True)
    event = triton_responses.whole_event(
        decoded, Completion("r", "!", FinishReason.LENGTH, Usage(2, 5))
    )
    assert event.text == "Hello!" and event.final
    body, _ = triton_responses.encode_stream_response(request, "m", decoded, event).to_rest()
    assert isinstance(body, dict)
    assert body["outputs"][1] == {"name": "num_output_tokens", "shape": [1], "datatype": "UINT32",
                                  "data": [5]}  # fmt: skip


# -- fuzz: whatever arrives is accepted or refused with a reason ---------------------------------

tensor_names = st.sampled_from([spec.name for spec in triton_tensors.INPUTS] + ["image"])
tensors = st.builds(
    lambda name, datatype, values: tensor(name, datatype, values),
    tensor_names,
    st.sampled_from(["BYTES", "BOOL", "INT32", "FP32", "UINT64"]),
    st.lists(
        st.booleans()
        | st.integers(0, 100)
        | st.floats()
        | any_text
        | st.sampled_from(['{"temperature": NaN}', '{"stop": "\\ud800"}', '{"top_p": 1e999}']),
        max_size=2,
    ),
)


@given(extra=st.lists(tensors, max_size=4), streaming=st.booleans())
@settings(max_examples=300, deadline=None, derandomize=True)
def test_infer_fuzz(extra: list[InferInput], streaming: bool) -> None:
    try:
        decoded = decode(v2(*extra), streaming)
    except InvalidRequest as exc:
        assert str(exc)
        return
    assert decoded.requests and decoded.outputs
    for request in decoded.requests:
        accepted_is_clean(request)
