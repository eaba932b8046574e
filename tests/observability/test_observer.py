"""The observer over a real engine: spans as the SDK exports them (its in-memory exporter behind
our processor), preemption events, the export queue's bound, tenants and request context."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from predictor.engine.async_engine import AsyncEngine
from predictor.engine.client import complete
from predictor.engine.kv_cache import BlockAllocator
from predictor.engine.scheduler import Scheduler
from predictor.engine.step_loop import StepLoop
from predictor.observability import context
from predictor.observability.metrics import Metrics
from predictor.observability.observer import Observer
from predictor.observability.tenants import TenantLabels
from predictor.observability.tracing import BoundedExport, Tracing
from predictor.types import GenerateRequest, SamplingParams
from tests.engine.conftest import Tiny


def tracing(exporter: SpanExporter, dropped: list[int]) -> Tracing:
    processor = BoundedExport(exporter, dropped.append, interval=0.05)
    provider = TracerProvider()
    provider.add_span_processor(processor)  # type: ignore[arg-type]
    return Tracing(provider, processor)


async def test_preempted_requests_carry_their_preemptions_as_span_events(
    tiny_dense: Tiny,
) -> None:
    block, blocks, max_tokens = 8, 20, 30  # a cache six requests outgrow: rows are preempted
    metrics = Metrics(CollectorRegistry(), "tiny")
    exporter = InMemorySpanExporter()
    dropped: list[int] = []
    observer = Observer(metrics, TenantLabels(4), tracing(exporter, dropped))
    runner = tiny_dense.runner(num_blocks=blocks, block_size=block)
    loop = StepLoop(runner, Scheduler(8, 64, BlockAllocator(blocks, block)), frozenset())
    engine = AsyncEngine(loop, tiny_dense.tokenizer, max_tokens_limit=64, max_prompt_tokens=100)
    engine.start()
    try:
        requests = [
            GenerateRequest(str(i), f"Request number {i} asks for text",
                            SamplingParams(max_tokens), tenant=f"t{i}")
            for i in range(6)
        ]  # fmt: skip
        await asyncio.gather(
            *(complete(observer.observe(engine.generate(r), "rest", r)) for r in requests)
        )
    finally:
        engine.stop()
    assert observer.tracing is not None and observer.tracing.flush(10)
    spans = {s.attributes["gen_ai.request.id"]: s for s in exporter.get_finished_spans()}
    assert sorted(spans) == [str(i) for i in range(6)] and not dropped
    preempted = [s for s in spans.values() if any(e.name == "preempted" for e in s.events)]
    assert preempted, "no request was preempted: the cache is too large for this test"
    for span in spans.values():
        names = [e.name for e in span.events]
        assert names[-1] == "finish" and set(names[:-1]) <= {"preempted"}
        times = [e.timestamp for e in span.events]
        assert span.start_time <= times[0] and times == sorted(times) and times[-1] <= span.end_time
        assert span.attributes["gen_ai.usage.output_tokens"] == max_tokens
        assert span.attributes["gen_ai.latency.time_in_queue"] >= 0.0
    # four tenant labels, then other
    assert sorted(s.attributes["predictor.tenant"] for s in spans.values()) == [
        "other", "other", "t0", "t1", "t2", "t3"
    ]  # fmt: skip


class SlowExporter(SpanExporter):
    """A collector that takes its time (or never answers)."""

    def __init__(self, seconds: float, result: SpanExportResult) -> None:
        self.seconds, self.result = seconds, result
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        time.sleep(self.seconds)
        return self.result

    def shutdown(self) -> None:
        pass


def test_a_full_queue_and_failed_exports_drop_and_count_never_block() -> None:
    dropped: list[int] = []
    processor = BoundedExport(
        SlowExporter(0.3, SpanExportResult.FAILURE), dropped.append, max_queue=4, max_batch=2,
        interval=0.01,
    )  # fmt: skip
    provider = TracerProvider()
    provider.add_span_processor(processor)  # type: ignore[arg-type]
    tracer = provider.get_tracer("t")
    start = time.monotonic()
    for i in range(40):
        tracer.start_span(f"s{i}").end()
    assert time.monotonic() - start < 0.2  # ending spans never waited for the exporter
    assert processor.force_flush(10_000)
    assert sum(dropped) == 40  # every span: refused by the queue or by the collector
    provider.shutdown()


def test_context_reads_trace_headers_and_the_tenant_header() -> None:
    pairs = [("traceparent", "00-ab-cd-01"), ("x-tenant", "blue"), ("tracestate", "k=v"),
             ("other", "x")]  # fmt: skip
    meta = context.read(pairs, "x-tenant")
    assert meta.trace == (("traceparent", "00-ab-cd-01"), ("tracestate", "k=v"))
    assert meta.tenant == "blue"
    assert context.read(pairs, "").tenant is None
    seen: list[context.RequestMeta] = []

    def elsewhere() -> None:  # another thread: its own (empty) context
        seen.append(context.current())

    token = context.bind(meta)
    try:
        assert context.current() is meta
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
    finally:
        context.unbind(token)
    assert seen == [context.RequestMeta()] and context.current() == context.RequestMeta()


def test_tenant_labels_are_bounded() -> None:
    labels = TenantLabels(2)
    assert [labels.label(t) for t in (None, "", "a", "b", "c", "a", "other", "none")] == [
        "none", "none", "a", "b", "other", "a", "other", "other"
    ]  # fmt: skip
