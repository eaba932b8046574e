"""Overload and deadlines on a server with 1 batch row and 1 waiting place."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import httpx
import pytest
from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc as pb_grpc

from tests.serving.test_grpc_stream import running_requests, wait_idle
from tests.serving.test_v2_grpc import infer_request
from tests.support import ServerProcess

# holds its row for 900 steps of the tiny model, never ending early; without drafts (the tiny
# model repeats one token, whose drafts end 900 tokens in a few steps: between a holder's end
# and its next request the queue had a place, and a request meant to be refused got in)
LONG = {
    "text_input": "Go on",
    "parameters": {"max_tokens": 900, "ignore_eos": True, "speculative": False},
}


def waiting_requests(server: ServerProcess) -> float:
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("predictor_num_requests_waiting{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no waiting gauge")


def hold(server: ServerProcess, stop: threading.Event) -> None:
    """Keep one row (running or waiting) until `stop`: LONG again as soon as it ends (its 900
    steps of the tiny model take under a second with the native kernels)."""
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            with client.stream(
                "POST", f"{server.base_url}/v2/models/tiny/generate_stream", json=LONG
            ) as response:
                for _ in response.iter_lines():
                    if stop.is_set():
                        return


@contextmanager
def full_queue(server: ServerProcess) -> Iterator[None]:
    """Two holders fill a server of 1 row and 1 waiting place; they stop on leaving, and the
    server is idle again."""
    stop = threading.Event()
    holders = [threading.Thread(target=hold, args=(server, stop)) for _ in range(2)]
    for t in holders:
        t.start()
        time.sleep(0.3)
    try:
        deadline = time.monotonic() + 10
        while not (running_requests(server) == 1 and waiting_requests(server) == 1):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield
    finally:
        stop.set()
        for t in holders:
            t.join(60)
    wait_idle(server)


def test_full_queue_gets_429_and_resource_exhausted_at_once(small: ServerProcess) -> None:
    with full_queue(small):
        started = time.monotonic()
        r = httpx.post(
            f"{small.base_url}/v2/models/tiny/generate", json={"text_input": "x"}, timeout=10
        )
        assert (
            r.status_code == 429 and r.headers["retry-after"] == "1" and "busy" in r.json()["error"]
        )
        s = httpx.post(
            f"{small.base_url}/v2/models/tiny/generate_stream", json={"text_input": "x"}, timeout=10
        )
        assert s.status_code == 429 and s.headers["content-type"] == "application/json"
        body = {
            "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["x"]}]
        }
        v2 = httpx.post(f"{small.base_url}/v2/models/tiny/infer", json=body, timeout=10)
        assert v2.status_code == 429 and v2.headers["retry-after"] == "1"
        with (
            grpc.insecure_channel(small.grpc_target) as channel,
            pytest.raises(grpc.RpcError) as info,
        ):
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                infer_request("tiny", [b"x"]), timeout=10
            )
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - started < 5  # refused at once, not queued


def test_request_timeout_parameter(small: ServerProcess) -> None:
    # no drafts: the tiny model repeats one token, whose drafts can make 500 tokens inside the
    # timeout on a fast CPU (seen in CI); one token a step, they take seconds
    body = {
        "text_input": "Go",
        "parameters": {"max_tokens": 500, "timeout": 0.2, "speculative": False},
    }
    r = httpx.post(f"{small.base_url}/v2/models/tiny/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    assert details["finish_reason"] == "timeout" and details["generated_tokens"] < 500
    wait_idle(small)


def test_grpc_deadline_frees_the_row(small: ServerProcess) -> None:
    request = infer_request("tiny", [b"Go"], max_tokens=500)
    # no drafts: the tiny model repeats one token, whose drafts make 500 tokens in well under
    # the deadline; one token a step, they take seconds
    request.parameters["speculative"].bool_param = False
    with grpc.insecure_channel(small.grpc_target) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(small)
