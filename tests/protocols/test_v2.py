import struct

import numpy as np
import pytest
from kserve import InferInput, InferRequest
from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb

from predictor.errors import InvalidRequest
from predictor.protocols import generate as oip
from predictor.protocols import limits, v2
from predictor.protocols.triton.requests import decode_infer_request as decode_v2
from predictor.types import Completion, FinishReason, GenerateRequest, Usage


def decode(request: InferRequest, default_max_tokens: int = 64) -> list[GenerateRequest]:
    return decode_v2(request, limits.Limits(default_max_tokens, 32), streaming=False).requests


def encode(request: InferRequest, done: list[Completion]) -> object:
    return v2.text_response(
        request, "m", done[0].request_id, [c.text for c in done], v2.usage_parameters(done)
    )


def _request(
    data: list[str], parameters: dict | None = None, datatype: str = "BYTES"
) -> InferRequest:
    inp = InferInput(name="text_input", shape=[len(data)], datatype=datatype, data=data)
    return InferRequest(model_name="m", infer_inputs=[inp], request_id="r", parameters=parameters)


def test_rest_parameters() -> None:
    reqs = decode(
        _request(
            ["a", "b"],
            {
                "max_tokens": 5,
                "temperature": 0.5,
                "top_p": 0.9,
                "top_k": 3,
                "seed": 7,
                "stop": ["\n"],
                "chat": True,
            },
        ),  # fmt: skip
        64,
    )
    assert [r.prompt for r in reqs] == ["a", "b"]
    assert [r.request_id for r in reqs] == ["r-0", "r-1"]
    p = reqs[0].params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (
        5,
        0.5,
        0.9,
        3,
        7,
        ("\n",),
    )
    assert reqs[0].chat is True


def test_grpc_parameter_map() -> None:
    msg = pb.ModelInferRequest(model_name="m", id="g")
    msg.parameters["max_tokens"].int64_param = 4
    # Triton's double_param (field 4) is not in KServe's InferParameter: send it as tritonclient does
    msg.parameters["temperature"].ParseFromString(b"\x21" + struct.pack("<d", 0.25))
    msg.parameters["seed"].ParseFromString(b"\x28\x07")  # uint64_param = 7 (field 5)
    msg.parameters["chat"].bool_param = True
    msg.parameters["stop"].string_param = '["x", "y"]'
    tensor = msg.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(b"hi")
    (req,) = decode(InferRequest.from_grpc(msg))
    assert req.prompt == "hi" and req.chat
    assert req.params.max_tokens == 4 and req.params.temperature == 0.25
    assert req.params.stop == ("x", "y")
    assert req.params.seed == 7


@pytest.mark.parametrize(
    "parameters",
    [{"max_tokens": 0}, {"max_tokens": "x"}, {"max_tokens": 1.5}, {"max_tokens": True},
     {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1}, {"seed": -3},
     {"stop": 5}, {"stop": ["x"] * 17}, {"stop": ["x" * 300]}, {"stop": [""]},
     {"chat": "yes"}, {"timeout": 0}],
)  # fmt: skip
def test_bad_parameters(parameters: dict) -> None:
    with pytest.raises(InvalidRequest):
        decode(_request(["a"], parameters))


def test_bad_inputs() -> None:
    with pytest.raises(InvalidRequest, match="missing"):
        decode(InferRequest(model_name="m", infer_inputs=[], request_id="r"), 64)
    with pytest.raises(InvalidRequest, match="BYTES"):
        decode(_request([1], datatype="INT32"), 64)  # type: ignore[list-item]
    with pytest.raises(InvalidRequest, match="empty"):
        decode(_request([""]), 64)
    msg = pb.ModelInferRequest(model_name="m", id="g")
    msg.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
        b"\xff\xfe"
    )
    with pytest.raises(InvalidRequest, match="UTF-8"):
        decode(InferRequest.from_grpc(msg), 64)


def test_response_rest_and_grpc() -> None:
    usage = Usage(3, 4, cached_tokens=2, draft_tokens=6, accepted_draft_tokens=1)
    done = [Completion("r", "héllo", FinishReason.LENGTH, usage)]
    rest = encode(_request(["a"]), done)
    body, _ = rest.to_rest()
    assert body["outputs"][0]["data"] == ["héllo"]
    assert body["parameters"] == {
        "prompt_tokens": 3,
        "generated_tokens": 4,
        "cached_tokens": 2,
        "draft_tokens": 6,
        "accepted_draft_tokens": 1,
        "finish_reason": "length",
    }
    msg = pb.ModelInferRequest(model_name="m", id="g")
    msg.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
        b"a"
    )
    grpc_response = encode(InferRequest.from_grpc(msg), done).to_grpc()  # type: ignore[attr-defined]
    assert len(grpc_response.raw_output_contents) == 1
    from kserve.protocol.infer_type import deserialize_bytes_tensor

    values = deserialize_bytes_tensor(grpc_response.raw_output_contents[0])
    assert np.array_equal(values, np.array(["héllo".encode()], dtype=object))


def test_null_parameters_take_their_defaults() -> None:
    (req,) = decode(
        _request(
            ["a"],
            {
                "max_tokens": None,
                "temperature": None,
                "top_k": None,
                "seed": None,
                "chat": None,
                "timeout": None,
            },
        ),
        9,
    )
    assert req.params.max_tokens == 9 and req.params.greedy and req.params.seed is None
    assert req.chat is False and req.timeout is None


def test_check_depth_counts_containers_only() -> None:
    limits.check_depth({"a": [{"b": ["x" * 10]}]}, max_depth=4)
    with pytest.raises(InvalidRequest, match="deeper than 3"):
        limits.check_depth({"a": [{"b": []}]}, max_depth=3)
    limits.check_depth({"a": "\ud800", "b": float("nan")}, max_depth=2)  # orjson refuses these


def test_check_plain_refuses_surrogates_in_non_ascii_strings_only() -> None:
    limits.check_plain({"a": "caf\u00e9 " * 1000, "b": "plain"}, 32)
    with pytest.raises(InvalidRequest, match="surrogate"):
        limits.check_plain({"a": "caf\u00e9 \ud800"}, 32)


def test_cache_salt_is_a_non_empty_string() -> None:
    body = {"text_input": "hi", "parameters": {"cache_salt": "tenant-7"}}
    lim = limits.Limits(8, 32)
    assert oip.decode_generate_request(body, lim, False)[0].cache_salt == "tenant-7"
    assert oip.decode_generate_request({"text_input": "hi"}, lim, False)[0].cache_salt is None
    for bad in ("", 5, "x" * 300):
        with pytest.raises(InvalidRequest, match="cache_salt"):
            oip.decode_generate_request(
                {"text_input": "hi", "parameters": {"cache_salt": bad}}, lim, False
            )
