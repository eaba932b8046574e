"""Real receivers for the telemetry of a server, on loopback ports (tests and benchmarks).

- `otlp_grpc_receiver`: OpenTelemetry's own OTLP/gRPC trace service (`TraceService.Export`, the
  opentelemetry-proto definitions a collector implements), recording every span it is sent.
- `otlp_http_receiver`: OTLP over HTTP/protobuf (`POST /v1/traces`), the same messages.
- `cloudevent_sink`: an HTTP endpoint taking CloudEvents in binary mode, as KServe's logger
  sinks (message-dumper) do.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]
    status_code: int
    start_ns: int
    end_ns: int
    service: str


@dataclass
class Spans:
    got: list[Span] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        Span(
                            s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                            s.kind, {a.key: _value(a.value) for a in s.attributes},
                            [(e.name, e.time_unix_nano,
                              {a.key: _value(a.value) for a in e.attributes}) for e in s.events],
                            s.status.code, s.start_time_unix_nano, s.end_time_unix_nano,
                            resource.get("service.name", ""),
                        )
                    )  # fmt: skip
        with self.cond:
            self.got.extend(spans)
            self.cond.notify_all()

    def wait_for(self, match: Callable[[Span], bool], timeout: float = 20.0) -> Span:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for span in self.got:
                    if match(span):
                        return span
                left = deadline - time.monotonic()
                assert left > 0, f"no such span among {[s.name for s in self.got]}"
                self.cond.wait(left)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, spans: Spans) -> None:
        self.spans = spans

    def Export(  # noqa: N802 (the protocol's name)
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.spans.take(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def otlp_grpc_receiver() -> Iterator[tuple[str, Spans]]:
    """(endpoint URL, the spans received)."""
    spans = Spans()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(spans), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", spans
    finally:
        server.stop(0)


@contextmanager
def _http_server(handle: Callable[[str, dict[str, str], bytes], int]) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            code = handle(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            self.send_response(code)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def otlp_http_receiver() -> Iterator[tuple[str, Spans]]:
    """(the traces endpoint URL, .../v1/traces, and the spans received)."""
    spans = Spans()

    def handle(path: str, headers: dict[str, str], body: bytes) -> int:
        if path != "/v1/traces" or headers.get("content-type") != "application/x-protobuf":
            return 404
        spans.take(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
        return 200

    with _http_server(handle) as url:
        yield f"{url}/v1/traces", spans


@dataclass
class CloudEvent:
    headers: dict[str, str]
    data: dict[str, Any]


@dataclass
class Events:
    got: list[CloudEvent] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def wait_for(self, match: Callable[[CloudEvent], bool], timeout: float = 20.0) -> CloudEvent:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for event in self.got:
                    if match(event):
                        return event
                left = deadline - time.monotonic()
                assert left > 0, f"no such event among {[e.data.get('id') for e in self.got]}"
                self.cond.wait(left)


@contextmanager
def cloudevent_sink() -> Iterator[tuple[str, Events]]:
    events = Events()

    def handle(path: str, headers: dict[str, str], body: bytes) -> int:
        if headers.get("ce-specversion") != "1.0" or not headers.get("ce-id"):
            return 400
        with events.cond:
            events.got.append(CloudEvent(headers, json.loads(body)))
            events.cond.notify_all()
        return 202

    with _http_server(handle) as url:
        yield url, events
