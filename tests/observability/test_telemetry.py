"""Traces, tenants and payload records from the real server, into real receivers: OTLP over
gRPC and HTTP/protobuf (OpenTelemetry's own trace service), and a CloudEvents sink."""

from __future__ import annotations

import hashlib
import json
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb
from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc as pb_grpc

from load.receivers import (
    Events,
    Spans,
    cloudevent_sink,
    otlp_grpc_receiver,
    otlp_http_receiver,
)
from predictor.pb.model_stream_infer_pb2 import ModelStreamInferResponse
from tests.support import ServerProcess

SERVER_KIND = 2  # OTLP's SPAN_KIND_SERVER
STATUS_ERROR = 2
LATENCIES = ("e2e", "time_in_queue", "time_to_first_token", "time_in_model_prefill",
             "time_in_model_decode")  # fmt: skip


def traceparent() -> tuple[str, str, str]:
    trace, parent = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace}-{parent}-01", trace, parent


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    """A sample's value on /metrics (0 when absent)."""
    want = {"model": "tiny", **labels}
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if not line.startswith(name + "{"):
            continue
        body = line[len(name) + 1 : line.rindex("}")]
        got = dict(part.split("=", 1) for part in body.split(",") if part)
        if {k: v.strip('"') for k, v in got.items()} == want:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def unlabelled(server: ServerProcess, name: str) -> float:
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def traced(tiny_gptq_dir: Path) -> Iterator[tuple[ServerProcess, Spans, Events]]:
    """Traces over OTLP/gRPC, full payload records, the tenant header, two tenant labels."""
    with otlp_grpc_receiver() as (endpoint, spans), cloudevent_sink() as (sink, events):
        extra = ["--otlp-traces-endpoint", endpoint, "--tenant-header", "X-Tenant",
                 "--max-tenant-labels", "2", "--log-payloads", "full",
                 "--payload-logger-url", sink]  # fmt: skip
        with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as server:
            yield server, spans, events


def test_a_chat_is_one_server_span_with_the_genai_attributes(
    traced: tuple[ServerProcess, Spans, Events],
) -> None:
    server, spans, _ = traced
    header, trace, parent = traceparent()
    answer = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 5, "user": "team-a", "seed": 3, "stop": ["zz"]},
        headers={"traceparent": header}, timeout=60,
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    span = spans.wait_for(lambda s: s.trace_id == trace)
    assert span.parent_span_id == parent and span.kind == SERVER_KIND
    assert span.name == "chat tiny" and span.service == "gptq-predictor"
    a = span.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.response.id"] == answer.json()["id"]
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.seed"] == 3
    assert a["gen_ai.request.stop_sequences"] == ["zz"]
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a["predictor.tenant"] == "team-a" and a["predictor.protocol"] == "openai"
    for name in LATENCIES:
        assert a[f"gen_ai.latency.{name}"] >= 0.0, name
    assert a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_to_first_token"]
    assert span.events[-1][0] == "finish" and span.status_code != STATUS_ERROR
    assert span.start_ns < span.events[-1][1] <= span.end_ns


def test_every_transport_carries_the_trace_context(
    traced: tuple[ServerProcess, Spans, Events],
) -> None:
    server, spans, _ = traced
    sent: dict[str, tuple[str, str]] = {}
    # OIP generate_stream (SSE)
    header, trace, parent = traceparent()
    sent["oip"] = trace, parent
    with httpx.stream(
        "POST", f"{server.base_url}/v2/models/tiny/generate_stream",
        json={"text_input": "Hi", "parameters": {"max_tokens": 3}},
        headers={"traceparent": header}, timeout=60,
    ) as events:  # fmt: skip
        assert events.status_code == 200 and "data:" in events.read().decode()
    # V2 infer over REST (KServe's route and LLMPredictor.predict)
    header, trace, parent = traceparent()
    sent["rest"] = trace, parent
    v2 = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hi"]}],
          "parameters": {"max_tokens": 2}}  # fmt: skip
    answer = httpx.post(
        f"{server.base_url}/v2/models/tiny/infer", json=v2, headers={"traceparent": header},
        timeout=60,
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    # gRPC: ModelInfer (KServe's servicer) and ModelStreamInfer (ours), trace in the metadata
    msg = pb.ModelInferRequest(model_name="tiny", id="g")
    msg.parameters["max_tokens"].int64_param = 2
    msg.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
        b"Hi"
    )
    with grpc.insecure_channel(server.grpc_target) as channel:
        header, trace, parent = traceparent()
        sent["grpc"] = trace, parent
        pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            msg, metadata=(("traceparent", header),), timeout=60
        )
        header, trace, parent = traceparent()
        sent["stream"] = trace, parent
        rpc = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=ModelStreamInferResponse.FromString,
        )
        assert list(rpc(iter([msg]), metadata=(("traceparent", header),), timeout=60))
    for how, (trace, parent) in sent.items():
        span = spans.wait_for(lambda s, t=trace: s.trace_id == t)
        assert span.parent_span_id == parent, how
        assert span.attributes["gen_ai.operation.name"] == "text_completion", how
        assert span.attributes["gen_ai.usage.output_tokens"] >= 1, how


def test_a_refused_request_is_an_error_span_and_an_error_count(
    traced: tuple[ServerProcess, Spans, Events],
) -> None:
    server, spans, _ = traced
    before = metric(server, "predictor_request_errors_total", api="openai",
                    reason="invalid_request")  # fmt: skip
    header, trace, _ = traceparent()
    schema = {"type": "string", "minLength": 5, "maxLength": 2}  # no text satisfies it
    answer = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 4,
              "response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": schema}}},
        headers={"traceparent": header}, timeout=60,
    )  # fmt: skip
    assert answer.status_code == 400, answer.text
    span = spans.wait_for(lambda s: s.trace_id == trace)
    assert span.status_code == STATUS_ERROR
    assert span.attributes["gen_ai.response.finish_reasons"] == ["rejected"]
    after = metric(server, "predictor_request_errors_total", api="openai",
                   reason="invalid_request")  # fmt: skip
    assert after == before + 1
    # errors before the engine count too: an unknown model over V2 REST
    missing = httpx.post(f"{server.base_url}/v2/models/nope/generate", json={"text_input": "x"})
    assert missing.status_code == 404
    assert metric(server, "predictor_request_errors_total", api="v2", reason="model_missing") >= 1
    assert metric(server, "predictor_model_ready") == 1.0


def _tokens_by_tenant(server: ServerProcess) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("predictor_generation_tokens_total{"):
            tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
            out[tenant] = float(line.rsplit(" ", 1)[1])
    return out


def test_tenants_label_the_usage_counters_within_the_bound(
    traced: tuple[ServerProcess, Spans, Events],
) -> None:
    server, _, _ = traced

    def ask(user: str | None, header: str | None) -> None:
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}
        if user:
            body["user"] = user
        answer = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60,
                            headers={"x-tenant": header} if header else {})  # fmt: skip
        assert answer.status_code == 200, answer.text

    before = _tokens_by_tenant(server)
    ask("team-a", None)
    ask("ignored", "team-b")  # a gateway's header wins over the body's user
    for i in range(4):  # past --max-tenant-labels 2: counted as other
        ask(f"crowd-{i}", None)
    ask(None, None)
    after = _tokens_by_tenant(server)
    grew = {t: after[t] - before.get(t, 0.0) for t in after if after[t] != before.get(t, 0.0)}
    assert "ignored" not in after
    assert set(after) - {"none", "other"} <= {"team-a", "team-b"}
    assert grew["other"] == 8.0 and grew["none"] == 2.0
    requests = metric(server, "predictor_requests_total", protocol="openai",
                      finish_reason="length", tenant="team-b")  # fmt: skip
    assert requests >= 1


def test_payload_records_hold_the_whole_streamed_answer(
    traced: tuple[ServerProcess, Spans, Events],
) -> None:
    server, spans, events = traced
    header, trace, _ = traceparent()
    text, rid = "", ""
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions",
        json={"model": "tiny", "prompt": "Once upon", "max_tokens": 6, "stream": True,
              "user": "team-a", "ignore_eos": True},
        headers={"traceparent": header}, timeout=60,
    ) as answer:  # fmt: skip
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                rid = chunk["id"]
                text += chunk["choices"][0]["text"] if chunk["choices"] else ""
    record = events.wait_for(lambda e: e.data["id"] == rid)
    assert record.headers["ce-type"] == "org.gptq-predictor.inference.record"
    assert record.headers["ce-source"] == "/models/tiny"
    data = record.data
    assert data["prompt"] == "Once upon" and data["response"] == text
    assert data["usage"]["completion_tokens"] == 6 and data["finish_reason"] == "length"
    assert data["tenant"] == "team-a" and data["protocol"] == "openai"
    assert data["parameters"]["max_tokens"] == 6
    assert data["trace_id"] == trace == spans.wait_for(lambda s: s.trace_id == trace).trace_id
    assert data["latency"]["time_to_first_token"] <= data["latency"]["e2e"]


def test_http_protobuf_traces_and_hashed_payloads(tiny_gptq_dir: Path) -> None:
    with otlp_http_receiver() as (endpoint, spans), cloudevent_sink() as (sink, events):
        extra = ["--otlp-traces-endpoint", endpoint, "--otlp-traces-protocol", "http/protobuf",
                 "--log-payloads", "hash", "--payload-logger-url", sink]  # fmt: skip
        with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as server:
            header, trace, parent = traceparent()
            answer = httpx.post(
                f"{server.base_url}/v2/models/tiny/generate",
                json={"text_input": "Hello", "parameters": {"max_tokens": 3}},
                headers={"traceparent": header}, timeout=60,
            )  # fmt: skip
            assert answer.status_code == 200, answer.text
            span = spans.wait_for(lambda s: s.trace_id == trace)
            assert span.parent_span_id == parent
            record = events.wait_for(lambda e: e.data["trace_id"] == trace).data
    output = answer.json()["text_output"]
    assert record["prompt"] == {"sha256": hashlib.sha256(b"Hello").hexdigest()}
    assert record["response"] == {"sha256": hashlib.sha256(output.encode()).hexdigest()}


def test_an_unreachable_collector_drops_spans_and_slows_nothing(tiny_gptq_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    extra = ["--otlp-traces-endpoint", dead, "--log-payloads", "hash",
             "--payload-logger-url", dead]  # fmt: skip
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as server:
        took = []
        for _ in range(6):
            start = time.monotonic()
            answer = httpx.post(
                f"{server.base_url}/v2/models/tiny/generate",
                json={"text_input": "Hi", "parameters": {"max_tokens": 2}}, timeout=60,
            )  # fmt: skip
            took.append(time.monotonic() - start)
            assert answer.status_code == 200, answer.text
        assert max(took) < 2.0, took  # an export that hangs would hold a request up for 5 s
        deadline = time.monotonic() + 30
        while (
            unlabelled(server, "predictor_otel_spans_dropped_total") < 6
            or unlabelled(server, "predictor_payload_records_dropped_total") < 6
        ):
            assert time.monotonic() < deadline, server.log()[-2000:]
            time.sleep(0.5)
