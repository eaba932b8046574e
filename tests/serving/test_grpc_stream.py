"""Triton's ModelStreamInfer with the real tritonclient (in a subprocess), and with raw stubs."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import httpx
from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb

from predictor.pb.model_stream_infer_pb2 import ModelStreamInferResponse
from tests.support import REPO, ServerProcess


def running_requests(server: ServerProcess) -> float:
    """predictor_num_requests_running from /metrics."""
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("predictor_num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("predictor_num_requests_running is not exported")


def wait_idle(server: ServerProcess, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while running_requests(server) != 0:
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.1)


def test_tritonclient_stream(server: ServerProcess) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.clients.triton_stream", server.grpc_target, "tiny"],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # both good requests streamed text, ended with an empty final response, and reported usage
    assert out["finals"] == {"a": 0, "b": 0}
    assert len(out["responses"]["a"]) >= 1 and len(out["responses"]["b"]) >= 1
    assert out["usage"] == {"a": 40, "b": 4}
    # the bad one got an error and did not close the stream for the others
    assert len(out["errors"]) == 1 and "max_tokens" in out["errors"][0]
    # they ran at the same time: responses of a and b interleave
    order = [i for i in out["order"] if i in ("a", "b")]
    assert order != sorted(order)
    assert out["cancelled"]
    wait_idle(server)


def stream_request(
    rid: str, prompt: bytes, max_tokens: int, empty_final: bool
) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="tiny", id=rid)
    msg.parameters["max_tokens"].int64_param = max_tokens
    if empty_final:
        msg.parameters["triton_enable_empty_final_response"].bool_param = True
    msg.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
        prompt
    )
    return msg


def call_stream(
    server: ServerProcess, requests: list[pb.ModelInferRequest]
) -> list[ModelStreamInferResponse]:
    with grpc.insecure_channel(server.grpc_target) as channel:
        rpc = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=ModelStreamInferResponse.FromString,
        )
        return list(rpc(iter(requests), timeout=60))


def test_every_response_carries_the_final_flag(server: ServerProcess) -> None:
    responses = call_stream(server, [stream_request("x", b"Hi", 3, empty_final=False)])
    flags = [r.infer_response.parameters["triton_final_response"].bool_param for r in responses]
    assert flags[-1] is True and not any(flags[:-1])
    last = responses[-1].infer_response
    assert last.parameters["generated_tokens"].int64_param == 3
    assert last.parameters["finish_reason"].string_param == "length"


def test_unknown_model_and_non_utf8_are_per_request_errors(server: ServerProcess) -> None:
    unknown = stream_request("u", b"Hi", 2, empty_final=True)
    unknown.model_name = "nope"
    responses = call_stream(
        server,
        [unknown, stream_request("n", b"\xff", 2, True), stream_request("ok", b"Hi", 2, True)],
    )
    errors = {r.infer_response.id: r.error_message for r in responses if r.error_message}
    assert "does not exist" in errors["u"] and "UTF-8" in errors["n"]
    assert responses[-1].infer_response.id == "ok"
    assert responses[-1].infer_response.parameters["triton_final_response"].bool_param


def test_cancelling_the_call_aborts_its_requests(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        rpc = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=ModelStreamInferResponse.FromString,
        )
        call = rpc(iter([stream_request(f"k{i}", b"Go", 500, True) for i in range(3)]))
        next(call)
        assert running_requests(server) >= 1
        call.cancel()
    wait_idle(server)
