"""Every edge of the served protocols (issue 11), on real servers: bad values are 4xx on every
route, limits hold, unary requests stop when their client leaves, repository control is off,
health tells the truth, and several prompts are one unit."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb
from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc as pb_grpc

from predictor.pb.model_stream_infer_pb2 import ModelStreamInferResponse
from tests.conftest import DEFAULT_MODEL, REPO
from tests.serving.test_grpc_stream import running_requests, stream_request, wait_idle
from tests.serving.test_v2_grpc import infer_request
from tests.support import ServerProcess

MiB = 1024 * 1024
MODEL_NAME = "smollm2-135m-instruct-gptq"


def engine_tokens(server: ServerProcess) -> float:
    """Tokens the engine generated so far: the sum of predictor_batch_size (rows per step)."""
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("predictor_batch_size_sum{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def infer_body(*prompts: str, max_tokens: int = 4) -> dict:
    tensor = {"name": "text_input", "shape": [len(prompts)], "datatype": "BYTES"}
    return {"inputs": [{**tensor, "data": list(prompts)}], "parameters": {"max_tokens": max_tokens}}


# -- point 5: every bad value is a 4xx ----------------------------------------------------------

BAD_BODIES = {
    "NaN": '{"text_input": "hi", "parameters": {"max_tokens": NaN}}',
    "Infinity": '{"text_input": "hi", "parameters": {"temperature": Infinity}}',
    "1e999": '{"text_input": "hi", "parameters": {"top_p": 1e999}}',
    "surrogate": '{"text_input": "\\ud800", "parameters": {"max_tokens": 2}}',
    "surrogate key": '{"text_input": "hi", "parameters": {"\\udfff": 1}}',
    "deep": '{"text_input": "hi", "parameters": {"x": ' + "[" * 100 + "]" * 100 + "}}",
    "very deep": "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_json_values_are_400_on_every_route(server: ServerProcess, name: str) -> None:
    body = BAD_BODIES[name]
    v2 = body.replace('"text_input": "hi"', '"inputs": []').replace(
        '"text_input": "\\ud800"', '"inputs": [{"name": "\\ud800"}]'
    )
    openai = body.replace('"text_input"', '"model": "tiny", "prompt"')
    routes = {
        "/v2/models/tiny/generate": body,
        "/v2/models/tiny/generate_stream": body,
        "/v2/models/tiny/infer": v2,
        "/v2/models/tiny/infer_stream": v2,
        "/v1/completions": openai,
        "/openai/v1/chat/completions": openai,
    }
    for path, text in routes.items():
        r = httpx.post(f"{server.base_url}{path}", content=text, timeout=30)
        assert r.status_code == 400, (path, r.status_code, r.text)
        error = r.json()["error"]
        assert error and "Traceback" not in r.text, (path, r.text)


def test_long_id_is_400(server: ServerProcess) -> None:
    long_id = "i" * 257
    r = httpx.post(
        f"{server.base_url}/v2/models/tiny/generate",
        json={"id": long_id, "text_input": "hi", "parameters": {"max_tokens": 2}},
        timeout=30,
    )
    assert r.status_code == 400 and "'id'" in r.json()["error"]
    r = httpx.post(
        f"{server.base_url}/v2/models/tiny/infer", json={**infer_body("hi"), "id": long_id}
    )
    assert r.status_code == 400 and "'id'" in r.json()["error"]


def grpc_stream(server: ServerProcess, messages: list) -> list[ModelStreamInferResponse]:
    with grpc.insecure_channel(server.grpc_target) as channel:
        rpc = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
            response_deserializer=ModelStreamInferResponse.FromString,
        )
        return list(rpc(iter(messages), timeout=60))


def test_bad_stream_requests_each_get_an_answer(server: ServerProcess) -> None:
    unknown = pb.ModelInferRequest(model_name="tiny", id="datatype")
    unknown.inputs.add(name="text_input", datatype="WEIRD", shape=[1])
    unknown.raw_input_contents.append(b"abc")
    mismatched = pb.ModelInferRequest(model_name="tiny", id="raw")
    mismatched.inputs.add(name="text_input", datatype="BYTES", shape=[2])
    mismatched.raw_input_contents.append(b"\x01\x00\x00\x00a")
    nan = stream_request("nan", b"hi", 2, False)
    nan.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    nan.inputs[-1].contents.bytes_contents.append(b'{"temperature": NaN}')
    surrogate = stream_request("sur", b"hi", 2, False)
    surrogate.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    surrogate.inputs[-1].contents.bytes_contents.append(b'{"stop": "\\ud800"}')
    ok = stream_request("ok", b"hi", 2, True)
    responses = grpc_stream(server, [unknown, mismatched, nan, surrogate, b"\xff\xff\xff", ok])
    errors = {r.infer_response.id: r.error_message for r in responses if r.error_message}
    assert set(errors) == {"datatype", "raw", "nan", "sur", ""}, errors
    assert "cannot be decoded" in errors[""] and "non-finite" in errors["nan"]
    assert "surrogate" in errors["sur"] and "internal" not in " ".join(errors.values())
    assert responses[-1].infer_response.id == "ok"


def test_undecodable_unary_grpc_is_invalid_argument(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        raw = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\xff\xff\xff\xff", timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- point 4: limits ----------------------------------------------------------------------------


def test_body_past_the_limit_is_413_and_grpc_resource_exhausted(server: ServerProcess) -> None:
    big = json.dumps({"text_input": "a" * (9 * MiB)})  # the default limit is 8 MiB
    r = httpx.post(f"{server.base_url}/v2/models/tiny/generate", content=big, timeout=60)
    assert r.status_code == 413 and "limit" in r.json()["error"]
    with grpc.insecure_channel(server.grpc_target) as channel, pytest.raises(grpc.RpcError) as e:
        pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            infer_request("tiny", [b"a" * (9 * MiB)]), timeout=60
        )
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture(scope="module")
def model_server() -> Iterator[ServerProcess]:
    """The real default model, 1 compute thread: its decode steps take what a real model's do
    (~20 ms here), where the tiny model's ~5 ms steps are below this machine's scheduling
    jitter."""
    if not DEFAULT_MODEL.is_dir():
        pytest.skip("run `make model` first (make test does)")
    # no speculation: a stall shows as one gap between tokens against their median, and a
    # step that keeps several drafts sends its tokens with no gap between them
    extra = ["--threads", "1", "--max-tokens-limit", "1000", "--speculative", "off"]
    with ServerProcess.start(DEFAULT_MODEL, MODEL_NAME, extra=extra) as srv:
        yield srv


def post_raw(port: int, path: str, body: bytes) -> tuple[int, dict]:
    """One HTTP/1.1 POST over a plain socket: next to nothing for this process to do while the
    server takes the body (httpx would spend this machine's CPU the server wants)."""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(head + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


# Tokens each reader's stream has before it closes: enough for a median gap. The streams outlast
# the three tries anyway (~9 s); only a slow machine waits for more (4 streams of 1 thread, 76 ms a
# token on a Xeon held to AVX2: 300 held the other test worker 17 s longer than 100).
MIN_EVENTS = 100


@pytest.mark.model
@pytest.mark.serial
def test_a_4mib_prompt_does_not_stall_other_streams(model_server: ServerProcess) -> None:
    huge = "The quick brown fox jumps over the lazy dog. " * (4 * MiB // 45)
    body = {"text_input": huge, "parameters": {"max_tokens": 2, "chat": True}}
    payload = json.dumps(body).encode()
    # four streams read in another process: this one's sending cannot skew their clocks
    readers = subprocess.Popen(
        [sys.executable, "-m", "tests.clients.sse_gaps", model_server.base_url, MODEL_NAME,
         "4", "900", str(MIN_EVENTS)],  # 900: to outlast the uploads on a slow machine
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert readers.stdout is not None
    started = readers.stdout.readline()  # each stream has its first token (however slow to start)
    assert started.strip() == "streaming", started + readers.communicate("stop\n")[1]
    windows = []
    for _ in range(3):  # three tries, 2.5 s apart: see below
        time.sleep(2.5)  # the streams are under way
        sent = time.monotonic()
        path = f"/v2/models/{MODEL_NAME}/generate"
        status, answer = post_raw(model_server.http_port, path, payload)
        windows.append((sent, time.monotonic()))
        assert status == 400 and "limit" in answer["error"]  # far past the prompt limit
    time.sleep(1.0)  # the streams go on past the last answer, then close (a client leaving)
    out, err = readers.communicate("stop\n", timeout=300)  # once each has MIN_EVENTS tokens
    assert readers.returncode == 0, err
    streams = json.loads(out.strip().splitlines()[-1])
    assert all(len(s) >= MIN_EVENTS and s[0] < windows[0][0] and s[-1] > windows[-1][1]
               for s in streams), [(len(s), s[0], s[-1]) for s in streams] + windows  # fmt: skip
    # per try, the largest gap of any stream that overlaps the request (first byte sent to
    # answer), against that stream's median gap. Gaps past 2x the median turn up here without
    # any big body too (one of 2.8x in 10 s of one stream, measured: other processes share the
    # 2 cores), and the first try pays first-time costs, so one try of three must hold the bar;
    # a real stall (parsing or tokenizing on the event loop) is there every time
    ratios = []
    for sent, answered in windows:
        worst = 0.0
        for arrivals in streams:
            gaps = [(b - a, a, b) for a, b in zip(arrivals, arrivals[1:], strict=False)]
            median = statistics.median(gap for gap, _, _ in gaps)
            meanwhile = [gap for gap, start, end in gaps if end >= sent and start <= answered]
            assert meanwhile
            worst = max(worst, max(meanwhile) / median)
        ratios.append(worst)
    assert min(ratios) < 2, ratios


STREAM_QUEUE = 4
# the client's HTTP/2 window, small and fixed (no BDP growth): what gRPC itself buffers for a
# reader that does not read stays a few responses, so the server's queue is what fills
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


@pytest.fixture(scope="module")
def small_queue(tiny_gptq_dir: Path) -> Iterator[ServerProcess]:
    # a grace well below the ~1 s the tiny model takes for 1000 tokens: the unread stream's
    # cancellation shows however small its responses (and so however many gRPC's window holds)
    # no speculation: the tiny model repeats one token, whose drafts would make its 1000
    # tokens a few steps of 9, ended before the grace
    extra = ["--stream-queue-size", str(STREAM_QUEUE), "--max-tokens-limit", "1000",
             "--max-json-depth", "64", "--slow-reader-grace", "0.2", "--speculative", "off"]  # fmt: skip
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as srv:
        yield srv


def test_max_json_depth_is_the_one_limit(small_queue: ServerProcess) -> None:
    """--max-json-depth 64: a generate body 40 deep is served (the codecs once walked every body
    again with a fixed 32 and refused it), one 70 deep is refused at the edge."""

    def nested(depth: int) -> object:
        value: object = "x"
        for _ in range(depth - 3):  # the body and `parameters` are two levels, the list one more
            value = [value]
        return {"text_input": "hi", "parameters": {"max_tokens": 2, "client": value}}

    url = f"{small_queue.base_url}/v2/models/tiny/generate"
    deep = httpx.post(url, json=nested(40), timeout=60)
    assert deep.status_code == 200, deep.text
    too_deep = httpx.post(url, json=nested(70), timeout=60)
    assert too_deep.status_code == 400 and "deeper than 64" in too_deep.json()["error"]


def test_a_stream_nobody_reads_is_cancelled_not_buffered(small_queue: ServerProcess) -> None:
    """A ModelStreamInfer client that stops reading: the stream's queue fills to
    --stream-queue-size, then its requests are cancelled (rows freed, nothing more buffered) and
    end with RESOURCE_EXHAUSTED when the client reads again; other streams run on meanwhile."""
    before = engine_tokens(small_queue)
    with grpc.insecure_channel(small_queue.grpc_target, options=SMALL_WINDOW) as channel:
        rpc = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=ModelStreamInferResponse.FromString,
        )
        # 1000 tokens (the model never ends early: see tests/support.py); not read until below
        call = rpc(iter([stream_request("slow", b"Go", 1000, True)]), timeout=120)
        other = grpc_stream(small_queue, [stream_request("other", b"Hi", 100, False)])
        done = other[-1].infer_response.parameters
        assert not any(r.error_message for r in other), other[-1]
        assert done["generated_tokens"].int64_param == 100
        assert done["finish_reason"].string_param == "length"
        wait_idle(small_queue, timeout=60)  # the unread request's row is freed
        slow_tokens = engine_tokens(small_queue) - before - 100
        assert slow_tokens < 900, slow_tokens  # cancelled: a natural end is 1000 tokens
        responses = list(call)
    texts = [r for r in responses if not r.error_message and r.infer_response.outputs]
    errors = [r for r in responses if r.error_message]
    # what was buffered: the server's queue, plus the little the 1 KiB window holds
    assert STREAM_QUEUE <= len(texts) <= STREAM_QUEUE + 12, len(texts)
    assert len(texts) < slow_tokens
    assert len(errors) == 1 and errors[0] is responses[-1]
    assert "RESOURCE_EXHAUSTED" in errors[0].error_message
    assert "--stream-queue-size" in errors[0].error_message
    assert errors[0].infer_response.id == "slow"
    assert errors[0].infer_response.parameters["triton_final_response"].bool_param
    assert "Traceback" not in small_queue.log()


# -- point 1: N prompts are one unit (over HTTP) -------------------------------------------------


def test_n_prompts_with_one_too_long_run_none(server: ServerProcess) -> None:
    wait_idle(server)
    before = engine_tokens(server)
    body = infer_body("one", "two", "word " * 2000, max_tokens=400)
    r = httpx.post(f"{server.base_url}/v2/models/tiny/infer", json=body, timeout=30)
    assert r.status_code == 400 and "limit" in r.json()["error"]
    time.sleep(0.5)
    assert running_requests(server) == 0 and engine_tokens(server) == before
    r = httpx.post(f"{server.base_url}/v2/models/tiny/infer", json=infer_body(*["x"] * 17))
    assert r.status_code == 400 and "limit is 16" in r.json()["error"]


# -- point 6 and 9: unary requests stop when the client leaves ------------------------------------


@pytest.mark.serial  # tokens made while this process notices and cancels
@pytest.mark.parametrize("route", ["generate", "infer", "openai"])
def test_unary_request_is_cancelled_when_the_client_disconnects(
    server: ServerProcess, route: str
) -> None:
    wait_idle(server)
    before = engine_tokens(server)
    path, body = {
        "generate": ("/v2/models/tiny/generate", {"text_input": "Go", "max_tokens": 500}),
        "infer": ("/v2/models/tiny/infer", infer_body("Go", max_tokens=500)),
        "openai": ("/v1/completions", {"model": "tiny", "prompt": "Go", "max_tokens": 500}),
    }[route]

    async def leave_early() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            task = asyncio.create_task(client.post(f"{server.base_url}{path}", json=body))
            deadline = time.monotonic() + 30
            while engine_tokens(server) - before < 3:  # generating for us
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            task.cancel()  # closes the connection
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(leave_early())
    wait_idle(server)
    generated = engine_tokens(server) - before
    # the natural end is 500; between the check that sees 3 tokens and the cancel, a /metrics
    # scrape and one 50 ms sleep pass, in which the tiny model makes up to ~100 tokens here
    assert generated < 250, f"{generated} tokens generated for a client that left"


@pytest.mark.serial
def test_streaming_disconnect_stops_generation(server: ServerProcess) -> None:
    wait_idle(server)
    before = engine_tokens(server)
    body = {"text_input": "Go", "parameters": {"max_tokens": 500}}
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{server.base_url}/v2/models/tiny/generate_stream", json=body) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    wait_idle(server)
    assert engine_tokens(server) - before < 100


# -- point 2 and 3: repository control, health ----------------------------------------------------


def test_repository_control_is_off_by_default(server: ServerProcess) -> None:
    for action in ("load", "unload"):
        r = httpx.post(f"{server.base_url}/v2/repository/models/tiny/{action}", timeout=10)
        assert r.status_code == 403 and "--model-control" in r.json()["error"]
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="tiny"))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert httpx.get(f"{server.base_url}/v2/models/tiny/ready", timeout=10).status_code == 200
    assert httpx.get(f"{server.base_url}/v2/health/live", timeout=10).json() == {"live": True}


@pytest.fixture(scope="module")
def controlled(tiny_gptq_dir: Path) -> Iterator[ServerProcess]:
    extra = ["--model-control", "true", "--max-stream-requests", "2", "--max-tokens-limit", "512"]
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as srv:
        yield srv


def test_rows_per_stream_are_bounded(controlled: ServerProcess) -> None:
    requests = [stream_request(f"s{i}", b"Go", 60, True) for i in range(4)]
    responses = grpc_stream(controlled, requests)
    errors = {r.infer_response.id: r.error_message for r in responses if r.error_message}
    assert set(errors) == {"s2", "s3"} and all("RESOURCE_EXHAUSTED" in e for e in errors.values())
    finals = [r.infer_response.id for r in responses if not r.error_message and
              r.infer_response.parameters["triton_final_response"].bool_param]  # fmt: skip
    assert sorted(finals) == ["s0", "s1"]


def test_unload_when_enabled_turns_readiness_false(controlled: ServerProcess) -> None:
    base = controlled.base_url
    assert httpx.get(f"{base}/v2/health/ready", timeout=10).status_code == 200
    r = httpx.post(f"{base}/v2/repository/models/tiny/unload", timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{base}/v2/health/ready", timeout=10).status_code == 503
    assert httpx.get(f"{base}/v2/models/tiny/ready", timeout=10).status_code in (404, 503)
    assert httpx.get(f"{base}/v2/health/live", timeout=10).status_code == 200
