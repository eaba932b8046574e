"""Every Prometheus collector, created once against a registry passed in.

Served on KServe's `/metrics` (the default registry) by `python -m predictor`; tests pass their
own registry. REST and gRPC, unary and streaming, are counted alike: each path's event stream
passes through `observability/observer.py`, which feeds the request collectors here; the step
loop feeds the batch, queue, prefix-cache, preemption and sleep ones; `serving/errors.py` counts
every error it renders (`observe_error`). Token and request counters carry a `tenant` label
(bounded: `observability/tenants.py`), so usage per team is one query.

The queue, running and KV-cache gauges are what KEDA and the Gateway API Inference Extension's
endpoint picker read; with `vllm_aliases` they are also exported under vLLM's names
(`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, labelled
`model_name` as vLLM does) for pickers and dashboards that expect those, and so are the prefix
cache's token counters and preemptions (`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`,
`vllm:num_preemptions`) and the cache's shape (`vllm:cache_config_info{block_size,
num_gpu_blocks}`, read by the endpoint picker's prefix scorer).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from predictor.observability.statistics import InferenceStatistics
from predictor.observability.tenants import NO_TENANT

if TYPE_CHECKING:  # annotations only
    from predictor.engine.kv_disk import Counts
    from predictor.engine.step import StepStats


def _event_loop_tasks() -> int:
    """Tasks on the running event loop (scrapes run on it); 0 when called off the loop."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:
        return 0


_Collector = Counter | Gauge | Histogram


@dataclass(frozen=True)
class MetricSpec:
    """One collector: the `Metrics` attribute it is, its Prometheus name (counters are exported
    with `_total`), kind, help and labels; a histogram's buckets; `vllm`: vLLM's name for the
    same quantity, exported too (labelled `model_name`) with `vllm_aliases`; `start`: the label
    values after the model's of the series on /metrics from the start (counters at 0, as vLLM's,
    so every series a dashboard plots exists), None for none."""

    attr: str
    kind: type[_Collector]
    name: str
    help: str
    labels: tuple[str, ...] = ("model",)
    buckets: tuple[float, ...] | None = None
    vllm: str | None = None
    start: tuple[str, ...] | None = None

    def create(self, registry: CollectorRegistry, alias: bool = False) -> _Collector:
        """The collector, or (`alias`) its copy under vLLM's name, labelled `model_name`."""
        name, help, labels = self.name, self.help, self.labels
        if alias:
            assert self.vllm is not None
            name, help = self.vllm, f"Same as {self.name} (vLLM's name)."
            labels = tuple("model_name" if label == "model" else label for label in labels)
        if self.buckets is not None:
            return Histogram(name, help, labels, registry=registry, buckets=self.buckets)
        return self.kind(name, help, labels, registry=registry)


# The declarations: a table, one spec a row, laid out by hand.
# fmt: off
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)
_WAKE_BUCKETS = (0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128)

METRICS: tuple[MetricSpec, ...] = (
    # a request's latencies
    MetricSpec("ttft", Histogram, "predictor_time_to_first_token_seconds",
               "Time from request to its first token.", buckets=_LATENCY_BUCKETS, start=()),
    MetricSpec("tpot", Histogram, "predictor_time_per_output_token_seconds",
               "Time between a request's tokens.", buckets=_LATENCY_BUCKETS, start=()),
    MetricSpec("e2e", Histogram, "predictor_e2e_request_latency_seconds",
               "Time from request to its last event.", buckets=_E2E_BUCKETS, start=()),
    MetricSpec("queue_time", Histogram, "predictor_queue_time_seconds",
               "Time a request waited for a batch row.", buckets=_LATENCY_BUCKETS, start=()),
    MetricSpec("batch_size", Histogram, "predictor_batch_size",
               "Rows that got a token in each engine step.", buckets=_BATCH_BUCKETS, start=()),
    # tokens, requests and errors
    MetricSpec("prompt_tokens", Counter, "predictor_prompt_tokens",
               "Prompt tokens of finished requests, by tenant.", ("model", "tenant"),
               start=(NO_TENANT,)),
    MetricSpec("generation_tokens", Counter, "predictor_generation_tokens",
               "Tokens generated, by tenant.", ("model", "tenant"), start=(NO_TENANT,)),
    MetricSpec("requests", Counter, "predictor_requests",
               "Requests that reached the engine, by protocol, finish reason (rejected: the "
               "engine refused it) and tenant.", ("model", "protocol", "finish_reason", "tenant")),
    MetricSpec("errors", Counter, "predictor_request_errors",
               "Requests answered with an error, by API (v2: V2 and OIP REST, openai, grpc) and "
               "reason (errors.STATUS_TABLE's: invalid_request, overloaded, ..., internal).",
               ("model", "api", "reason")),
    MetricSpec("ready", Gauge, "predictor_model_ready",
               "1 while the model takes requests (readiness), else 0."),
    # what the exporters dropped
    MetricSpec("spans_dropped", Counter, "predictor_otel_spans_dropped",
               "Trace spans dropped: the export queue was full, or the collector failed or was "
               "too slow.", ()),
    MetricSpec("payloads_dropped", Counter, "predictor_payload_records_dropped",
               "Payload records dropped: the queue was full, or the sink failed.", ()),
    MetricSpec("kv_events_dropped", Counter, "predictor_kv_events_dropped",
               "KV-cache event batches dropped (--kv-events-config): the publisher's queue "
               "(max_queue_size) was full, so a step's batch never went out.", ()),
    # sleep
    MetricSpec("sleeps", Counter, "predictor_sleeps",
               "Times the engine freed the model's weights and KV cache, by reason (idle: "
               "--sleep-idle-seconds; asked: POST /sleep).", ("model", "reason")),
    MetricSpec("wake_ups", Counter, "predictor_wake_ups",
               "Times the engine loaded the model again after a sleep (a request or POST "
               "/wake_up waited for it).", start=()),
    MetricSpec("wake_time", Histogram, "predictor_wake_up_seconds",
               "Time a wake from a sleep took (the model loaded again, its kernels bound), "
               "which the requests waiting then waited.", buckets=_WAKE_BUCKETS, start=()),
    MetricSpec("sleeping", Gauge, "predictor_sleeping",
               "1 while the model's weights and KV cache are freed (asleep)."),
    # the batch and the KV cache (what KEDA and the endpoint picker read)
    MetricSpec("running", Gauge, "predictor_num_requests_running",
               "Requests holding a batch row.", vllm="vllm:num_requests_running"),
    MetricSpec("waiting", Gauge, "predictor_num_requests_waiting",
               "Requests waiting for a batch row.", vllm="vllm:num_requests_waiting"),
    MetricSpec("kv_cache_usage", Gauge, "predictor_kv_cache_usage_ratio",
               "Share of the KV cache's blocks held by running requests (0-1); cached prefixes "
               "no request holds count as free.", vllm="vllm:kv_cache_usage_perc"),
    MetricSpec("prefix_cache_queries", Counter, "predictor_prefix_cache_queries",
               "Prompt tokens looked up in the prefix cache (at each request's admission).",
               vllm="vllm:prefix_cache_queries", start=()),
    MetricSpec("prefix_cache_hits", Counter, "predictor_prefix_cache_hits",
               "Prompt tokens found in the prefix cache (not computed).",
               vllm="vllm:prefix_cache_hits", start=()),
    MetricSpec("preemptions", Counter, "predictor_num_preemptions",
               "Rows preempted (blocks freed, recomputed later) because the KV cache was full.",
               vllm="vllm:num_preemptions", start=()),
    MetricSpec("cache_config", Gauge, "predictor_cache_config_info",
               "The KV cache's shape (value 1).",
               ("block_size", "num_gpu_blocks", "enable_prefix_caching"),
               vllm="vllm:cache_config_info"),
    # speculative decoding
    MetricSpec("spec_drafts", Counter, "predictor_spec_decode_num_drafts",
               "Speculative decoding: rows that verified draft tokens (one per row and step).",
               vllm="vllm:spec_decode_num_drafts", start=()),
    MetricSpec("spec_draft_tokens", Counter, "predictor_spec_decode_num_draft_tokens",
               "Speculative decoding: draft tokens verified.",
               vllm="vllm:spec_decode_num_draft_tokens", start=()),
    MetricSpec("spec_accepted", Counter, "predictor_spec_decode_num_accepted_tokens",
               "Speculative decoding: draft tokens accepted (the model produced them itself).",
               vllm="vllm:spec_decode_num_accepted_tokens", start=()),
    MetricSpec("spec_per_position", Counter, "predictor_spec_decode_num_accepted_tokens_per_pos",
               "Speculative decoding: drafts accepted at each position.", ("model", "position"),
               vllm="vllm:spec_decode_num_accepted_tokens_per_pos"),
    # the server
    MetricSpec("loop_tasks", Gauge, "predictor_event_loop_tasks",
               "asyncio tasks alive on the server's event loop.", ()),
)
# fmt: on


class Metrics:
    """The collectors of `METRICS`, one attribute each (named by the spec's `attr`), and their
    vLLM aliases."""

    ttft: Histogram
    tpot: Histogram
    e2e: Histogram
    queue_time: Histogram
    batch_size: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    requests: Counter
    errors: Counter
    ready: Gauge
    spans_dropped: Counter
    payloads_dropped: Counter
    kv_events_dropped: Counter
    sleeps: Counter
    wake_ups: Counter
    wake_time: Histogram
    sleeping: Gauge
    running: Gauge
    waiting: Gauge
    kv_cache_usage: Gauge
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    preemptions: Counter
    cache_config: Gauge
    spec_drafts: Counter
    spec_draft_tokens: Counter
    spec_accepted: Counter
    spec_per_position: Counter
    loop_tasks: Gauge

    def __init__(
        self, registry: CollectorRegistry, model_name: str, vllm_aliases: bool = False
    ) -> None:
        self.model_name = model_name
        self._registry = registry
        self._vllm_aliases = vllm_aliases
        # our attribute -> the vLLM-named copy (with vllm_aliases)
        self._aliases: dict[str, _Collector] = {}
        for spec in METRICS:
            setattr(self, spec.attr, spec.create(registry))
            if vllm_aliases and spec.vllm is not None:
                self._aliases[spec.attr] = spec.create(registry, alias=True)
            if spec.start is not None:
                for each in self._each(spec.attr):
                    each.labels(model_name, *spec.start)
        self.loop_tasks.set_function(_event_loop_tasks)
        self.statistics = InferenceStatistics()  # Triton's ModelStatistics, from the same events

    def track_ready(self, ready: Callable[[], bool]) -> None:
        self.ready.labels(self.model_name).set_function(lambda: float(ready()))

    def track_sleeping(self, sleeping: Callable[[], bool]) -> None:
        """`sleeping`: whether the engine is asleep now, read at each scrape."""
        self.sleeping.labels(self.model_name).set_function(lambda: float(sleeping()))

    def observe_error(self, api: str, reason: str) -> None:
        """Called by `serving/errors.py` for each error it renders."""
        self.errors.labels(self.model_name, api, reason).inc()

    def track_engine(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        self._track("running", running)
        self._track("waiting", waiting)

    def track_lora(self, read: Callable[[], LoraRequests]) -> None:
        """The LoRA adapters' gauge the Gateway API Inference Extension routes by (vLLM's
        `vllm:lora_requests_info`): one series, read at each scrape, labelled with how many
        adapters may run at once and the adapters of the running and the waiting requests
        (comma-separated); its value is the time it was read, as vLLM's (the picker takes the
        newest series)."""
        names = [LORA_INFO] + ([VLLM_LORA_INFO] if self._vllm_aliases else [])
        self._registry.register(_LoraInfo(names, read))

    def track_kv_offload(self, counts: Callable[[], Counts], used: Callable[[], int]) -> None:
        """The disk cache's counters and size (--kv-offload-dir), read at each scrape."""
        self._registry.register(_KVOffload(self.model_name, counts, used))

    def track_kv_cache(self, usage: Callable[[], float]) -> None:
        """`usage`: the fraction of the KV-cache budget in use now, read at each scrape."""
        self._track("kv_cache_usage", usage)

    def describe_cache(self, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        """Publish the KV cache's shape (once, at start)."""
        values = (str(block_size), str(num_blocks), str(prefix_caching))
        for gauge in self._gauges("cache_config"):
            gauge.labels(*values).set(1)

    def observe_step(self, stats: StepStats) -> None:
        """Called after each engine step (on the step loop's thread) with what it did."""
        if stats.sampled:
            self.observe_batch(stats.sampled)
        for seconds in stats.queue_waits:
            self.observe_queue(seconds)
        for queried, hits in stats.prefix_queries:
            self.observe_prefix_cache(queried, hits)
        for _ in range(stats.preemptions):
            self.observe_preemption()
        if stats.slept:
            self.sleeps.labels(self.model_name, stats.slept).inc()
        if stats.woke:
            self.wake_ups.labels(self.model_name).inc()
            self.wake_time.labels(self.model_name).observe(stats.woke)
        if stats.draft_rows:
            self._count("spec_drafts", stats.draft_rows)
            self._count("spec_draft_tokens", stats.draft_tokens)
            self._count("spec_accepted", stats.accepted_tokens)
            for position, accepted in enumerate(stats.accepted_per_position):
                self._count("spec_per_position", accepted, str(position))

    def observe_prefix_cache(self, queried: int, hits: int) -> None:
        """At a request's first admission: its prompt tokens, and how many of them the prefix
        cache held."""
        self._count("prefix_cache_queries", queried)
        self._count("prefix_cache_hits", hits)

    def observe_preemption(self) -> None:
        self._count("preemptions", 1)

    def _count(self, attr: str, amount: float, *labels: str) -> None:
        """The counter `attr` (and its vLLM alias), the model's series (`labels` after it)."""
        for collector in self._each(attr):
            assert isinstance(collector, Counter)
            collector.labels(self.model_name, *labels).inc(amount)

    def _track(self, attr: str, read: Callable[[], float]) -> None:
        """The gauge `attr` (and its vLLM alias) reads `read` at each scrape."""
        for gauge in self._gauges(attr):
            gauge.labels(self.model_name).set_function(read)

    def _gauges(self, attr: str) -> list[Gauge]:
        gauges = self._each(attr)
        assert all(isinstance(gauge, Gauge) for gauge in gauges)
        return cast(list[Gauge], gauges)

    def _each(self, attr: str) -> list[_Collector]:
        """The collector `attr`, then its vLLM alias if it is exported."""
        alias = self._aliases.get(attr)
        return [getattr(self, attr)] + ([alias] if alias is not None else [])

    def observe_batch(self, rows: int) -> None:
        """After each step that produced tokens, with their number."""
        self.batch_size.labels(self.model_name).observe(rows)
        self.statistics.record_execution()

    def observe_queue(self, seconds: float) -> None:
        """When a request gets its row: how long it waited."""
        self.queue_time.labels(self.model_name).observe(seconds)
        self.statistics.record_queue(seconds)


LORA_INFO = "predictor_lora_requests_info"
VLLM_LORA_INFO = "vllm:lora_requests_info"
# (adapters that may run at once, adapters of running requests, of waiting ones)
LoraRequests = tuple[int, list[str], list[str]]


class _LoraInfo(Collector):
    def __init__(self, names: list[str], read: Callable[[], LoraRequests]) -> None:
        self._names = names
        self._read = read

    def collect(self) -> Iterator[Metric]:
        max_lora, running, waiting = self._read()
        values = [str(max_lora), ",".join(sorted(set(running))), ",".join(sorted(set(waiting)))]
        for name in self._names:
            family = GaugeMetricFamily(
                name,
                "LoRA adapters: how many may run at once, of the running and the waiting "
                "requests (vLLM's); the value is when it was read",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            family.add_metric(values, time.time())
            yield family


class _KVOffload(Collector):
    """predictor_kv_offload_blocks_total{event}: blocks the disk cache stored, loaded (read
    back instead of computed), dropped (its writer's queue was full), rejected (a file failed
    its checks: corrupt, truncated, another model's; never served) and evicted (past
    --kv-offload-size); predictor_kv_offload_bytes: its files' size now."""

    EVENTS = ("stored", "loaded", "dropped", "rejected", "evicted")

    def __init__(self, model: str, counts: Callable[[], Counts], used: Callable[[], int]) -> None:
        self._model = model
        self._counts = counts
        self._used = used

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        blocks = CounterMetricFamily(
            "predictor_kv_offload_blocks",
            "KV-cache blocks the disk cache (--kv-offload-dir) stored, loaded instead of "
            "computing them, dropped (its writer's queue full), rejected (a file failed its "
            "checks; never served) and evicted (past --kv-offload-size).",
            labels=["model", "event"],
        )
        for event in self.EVENTS:
            blocks.add_metric([self._model, event], getattr(counts, event))
        yield blocks
        size = GaugeMetricFamily(
            "predictor_kv_offload_bytes",
            "Bytes of the disk cache's block files now.",
            labels=["model"],
        )
        size.add_metric([self._model], self._used())
        yield size
