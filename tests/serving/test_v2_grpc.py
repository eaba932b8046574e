"""V2 gRPC against the real server: KServe's stubs here, tritonclient.grpc in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb
from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc as pb_grpc
from kserve.protocol.infer_type import deserialize_bytes_tensor

from tests.support import REPO, ServerProcess


def infer_request(model: str, prompts: list[bytes], max_tokens: int = 4) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=model, id="g1")
    msg.parameters["max_tokens"].int64_param = max_tokens
    tensor = msg.inputs.add(name="text_input", datatype="BYTES", shape=[len(prompts)])
    tensor.contents.bytes_contents.extend(prompts)
    return msg


def test_model_infer(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerReady(pb.ServerReadyRequest()).ready
        response = stub.ModelInfer(infer_request("tiny", [b"Hello", b"World"]), timeout=60)
    assert response.id == "g1"
    assert response.outputs[0].name == "text_output"
    texts = deserialize_bytes_tensor(response.raw_output_contents[0])
    assert len(texts) == 2
    assert response.parameters["generated_tokens"].int64_param == 8


@pytest.mark.parametrize(
    ("msg", "code"),
    [
        (infer_request("tiny", [b"\xff\xfe"]), grpc.StatusCode.INVALID_ARGUMENT),
        (infer_request("tiny", [b"x"], max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
        (infer_request("tiny", [b"x"], max_tokens=1000), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.ModelInferRequest(model_name="tiny", id="e"), grpc.StatusCode.INVALID_ARGUMENT),
        (infer_request("nope", [b"x"]), grpc.StatusCode.NOT_FOUND),
    ],
)
def test_bad_requests(
    server: ServerProcess, msg: pb.ModelInferRequest, code: grpc.StatusCode
) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(msg, timeout=30)
    assert info.value.code() == code


def run_triton_client(server: ServerProcess, action: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.clients.triton_grpc", server.grpc_target, "tiny", action],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tritonclient_grpc_infer(server: ServerProcess) -> None:
    out = run_triton_client(server, "infer")
    assert out["ready"] and out["model_ready"]
    assert len(out["texts"]) == 2
    assert out["generated_tokens"] == 10


def test_tritonclient_grpc_errors(server: ServerProcess) -> None:
    assert run_triton_client(server, "bad_utf8")["error_status"] == "StatusCode.INVALID_ARGUMENT"
    assert run_triton_client(server, "unknown_model")["error_status"] == "StatusCode.NOT_FOUND"
