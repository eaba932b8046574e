"""OpenTelemetry traces: one server span per request, exported off every hot path.

Off unless `--otlp-traces-endpoint` (or OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT) is set; then the
OpenTelemetry SDK (imported only then) sends spans over OTLP, gRPC or HTTP/protobuf. The span is
made whole when the request ends (`observer.py` calls `record`): its attributes are the GenAI
semantic conventions' (`gen_ai.operation.name`, `gen_ai.request.*`, `gen_ai.usage.*`,
`gen_ai.response.*`) and vLLM's latency attributes (`gen_ai.latency.time_in_queue`,
`time_to_first_token`, `time_in_model_prefill`, `time_in_model_decode`, `e2e`), with an event
for each preemption and one for the finish; a W3C `traceparent` the client sent makes it a child.
Nothing is traced while tokens flow: one span is built per request, at its end, on the event loop.

`BoundedExport` replaces the SDK's batch processor for one reason: it counts what it drops. A
full queue or a batch the collector refused or never answered (down, slow: the exporter's retries
run on the export thread, never on the event loop or the step loop) adds to
`predictor_otel_spans_dropped_total`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

SERVICE_NAME = "gptq-predictor"
MAX_QUEUE = 2048  # spans waiting for export; more are dropped (and counted)
MAX_BATCH = 256  # spans per export call
EXPORT_INTERVAL = 1.0  # seconds a partial batch may wait
EXPORT_TIMEOUT = 5.0  # seconds one export (with the exporter's retries) may take


@dataclass(frozen=True)
class SpanRecord:
    """One request's span, whole: times in nanoseconds since the epoch."""

    name: str
    start_ns: int
    end_ns: int
    parent: tuple[tuple[str, str], ...]  # the W3C trace context headers the client sent
    attributes: Mapping[str, Any]
    events: Sequence[tuple[str, int, Mapping[str, Any]]] = ()  # (name, time, attributes)
    error: str | None = None  # the span's status description when the request failed


class BoundedExport:
    """A span processor (OpenTelemetry's SpanProcessor protocol): a bounded queue and one
    export thread; every span dropped is counted through `on_drop`."""

    def __init__(
        self,
        exporter: SpanExporter,
        on_drop: Callable[[int], None],
        max_queue: int = MAX_QUEUE,
        max_batch: int = MAX_BATCH,
        interval: float = EXPORT_INTERVAL,
    ) -> None:
        self._exporter = exporter
        self._on_drop = on_drop
        self._queue: queue.Queue[ReadableSpan | None] = queue.Queue(max_queue)
        self._max_batch = max_batch
        self._interval = interval
        self._flushed = threading.Condition()
        self._pending = 0  # spans taken in but not yet exported or dropped
        self._thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def _on_ending(self, span: Any) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        with self._flushed:
            self._pending += 1
        try:
            self._queue.put_nowait(span)
        except queue.Full:
            self._settle(1, dropped=True)

    def _settle(self, count: int, dropped: bool) -> None:
        if dropped:
            self._on_drop(count)
        with self._flushed:
            self._pending -= count
            self._flushed.notify_all()

    def _run(self) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        stopping = False
        while not stopping:
            batch: list[ReadableSpan] = []
            try:
                first = self._queue.get(timeout=self._interval)
            except queue.Empty:
                continue
            if first is None:
                stopping = True
            else:
                batch.append(first)
            while len(batch) < self._max_batch and not stopping:
                try:
                    span = self._queue.get_nowait()
                except queue.Empty:
                    break
                if span is None:
                    stopping = True
                else:
                    batch.append(span)
            if not batch:
                continue
            try:
                ok = self._exporter.export(batch) is SpanExportResult.SUCCESS
            except Exception:  # the exporter's own failure: the spans are lost, never the loop
                log.exception("exporting %d spans failed", len(batch))
                ok = False
            self._settle(len(batch), dropped=not ok)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Wait until every span taken in is exported or dropped."""
        with self._flushed:
            return self._flushed.wait_for(lambda: self._pending == 0, timeout_millis / 1000)

    def shutdown(self) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._thread.join(EXPORT_TIMEOUT + 1.0)
        self._exporter.shutdown()


class Tracing:
    """The server's tracer: `record` turns a finished request's SpanRecord into a span."""

    def __init__(self, provider: TracerProvider, processor: BoundedExport) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = provider
        self._processor = processor
        self._tracer = provider.get_tracer("predictor")
        self._propagator = TraceContextTextMapPropagator()
        self._server = SpanKind.SERVER

    def record(self, span: SpanRecord) -> str | None:
        """Build and end the span; its trace id (32 hex digits), for the payload record."""
        from opentelemetry.trace import Status, StatusCode

        parent = self._propagator.extract(dict(span.parent)) if span.parent else None
        made = self._tracer.start_span(
            span.name,
            context=parent,
            kind=self._server,
            attributes=dict(span.attributes),
            start_time=span.start_ns,
        )
        for name, at, attributes in span.events:
            made.add_event(name, dict(attributes), timestamp=at)
        if span.error is not None:
            made.set_status(Status(StatusCode.ERROR, span.error))
        made.end(end_time=span.end_ns)
        return format(made.get_span_context().trace_id, "032x")

    def flush(self, timeout: float = 30.0) -> bool:
        return self._processor.force_flush(int(timeout * 1000))

    def shutdown(self) -> None:
        self._provider.shutdown()


def start_tracing(
    endpoint: str, protocol: str, on_drop: Callable[[int], None], service: str = SERVICE_NAME
) -> Tracing:
    """The tracer exporting to `endpoint` over `protocol` ("grpc" or "http/protobuf")."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    exporter: SpanExporter
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPSpanExporter,
        )

        exporter = HTTPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT)
    processor = BoundedExport(exporter, on_drop)
    resource = Resource.create()  # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, if set
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": service}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(processor)  # type: ignore[arg-type]
    log.info("tracing: spans go to %s over OTLP %s", endpoint, protocol)
    return Tracing(provider, processor)
