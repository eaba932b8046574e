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
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from predictor.observability.statistics import InferenceStatistics
from predictor.observability.tenants import NO_TENANT

if TYPE_CHECKING:  # annotations only
    from predictor.engine.kv_disk import Counts
    from predictor.engine.step import StepStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)
_WAKE_BUCKETS = (0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128)


def _event_loop_tasks() -> int:
    """Tasks on the running event loop (scrapes run on it); 0 when called off the loop."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:
        return 0


# our gauge -> vLLM's name for the same quantity
VLLM_ALIASES = {
    "predictor_num_requests_waiting": "vllm:num_requests_waiting",
    "predictor_num_requests_running": "vllm:num_requests_running",
    "predictor_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
}
# our counter -> vLLM's (both exported with the _total suffix)
VLLM_COUNTER_ALIASES = {
    "predictor_prefix_cache_queries": "vllm:prefix_cache_queries",
    "predictor_prefix_cache_hits": "vllm:prefix_cache_hits",
    "predictor_num_preemptions": "vllm:num_preemptions",
    "predictor_spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "predictor_spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "predictor_spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
SPEC_PER_POSITION = "predictor_spec_decode_num_accepted_tokens_per_pos"
VLLM_SPEC_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
_CACHE_LABELS = ["block_size", "num_gpu_blocks", "enable_prefix_caching"]


class Metrics:
    def __init__(
        self, registry: CollectorRegistry, model_name: str, vllm_aliases: bool = False
    ) -> None:
        self.model_name = model_name
        self._registry = registry
        self._vllm_aliases = vllm_aliases
        labels = ["model"]
        self.ttft = Histogram(
            "predictor_time_to_first_token_seconds", "Time from request to its first token.",
            labels, registry=registry, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.tpot = Histogram(
            "predictor_time_per_output_token_seconds", "Time between a request's tokens.",
            labels, registry=registry, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.e2e = Histogram(
            "predictor_e2e_request_latency_seconds", "Time from request to its last event.",
            labels, registry=registry, buckets=_E2E_BUCKETS,
        )  # fmt: skip
        self.queue_time = Histogram(
            "predictor_queue_time_seconds", "Time a request waited for a batch row.",
            labels, registry=registry, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.batch_size = Histogram(
            "predictor_batch_size", "Rows that got a token in each engine step.",
            labels, registry=registry, buckets=_BATCH_BUCKETS,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "predictor_prompt_tokens", "Prompt tokens of finished requests, by tenant.",
            ["model", "tenant"], registry=registry,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "predictor_generation_tokens", "Tokens generated, by tenant.", ["model", "tenant"],
            registry=registry,
        )  # fmt: skip
        self.requests = Counter(
            "predictor_requests",
            "Requests that reached the engine, by protocol, finish reason (rejected: the engine "
            "refused it) and tenant.",
            ["model", "protocol", "finish_reason", "tenant"], registry=registry,
        )  # fmt: skip
        self.errors = Counter(
            "predictor_request_errors",
            "Requests answered with an error, by API (v2: V2 and OIP REST, openai, grpc) and "
            "reason (errors.STATUS_TABLE's: invalid_request, overloaded, ..., internal).",
            ["model", "api", "reason"], registry=registry,
        )  # fmt: skip
        self.ready = Gauge(
            "predictor_model_ready", "1 while the model takes requests (readiness), else 0.",
            labels, registry=registry,
        )  # fmt: skip
        self.spans_dropped = Counter(
            "predictor_otel_spans_dropped",
            "Trace spans dropped: the export queue was full, or the collector failed or was "
            "too slow.", registry=registry,
        )  # fmt: skip
        self.payloads_dropped = Counter(
            "predictor_payload_records_dropped",
            "Payload records dropped: the queue was full, or the sink failed.",
            registry=registry,
        )  # fmt: skip
        self.kv_events_dropped = Counter(
            "predictor_kv_events_dropped",
            "KV-cache event batches dropped (--kv-events-config): the publisher's queue "
            "(max_queue_size) was full, so a step's batch never went out.", registry=registry,
        )  # fmt: skip
        self.sleeps = Counter(
            "predictor_sleeps",
            "Times the engine freed the model's weights and KV cache, by reason (idle: "
            "--sleep-idle-seconds; asked: POST /sleep).", ["model", "reason"], registry=registry,
        )  # fmt: skip
        self.wake_ups = Counter(
            "predictor_wake_ups",
            "Times the engine loaded the model again after a sleep (a request or POST /wake_up "
            "waited for it).", labels, registry=registry,
        )  # fmt: skip
        self.wake_time = Histogram(
            "predictor_wake_up_seconds", "Time a wake from a sleep took (the model loaded "
            "again, its kernels bound), which the requests waiting then waited.",
            labels, registry=registry, buckets=_WAKE_BUCKETS,
        )  # fmt: skip
        self.sleeping = Gauge(
            "predictor_sleeping", "1 while the model's weights and KV cache are freed (asleep).",
            labels, registry=registry,
        )  # fmt: skip
        self.running = Gauge(
            "predictor_num_requests_running", "Requests holding a batch row.", labels,
            registry=registry,
        )  # fmt: skip
        self.waiting = Gauge(
            "predictor_num_requests_waiting", "Requests waiting for a batch row.", labels,
            registry=registry,
        )  # fmt: skip
        self.kv_cache_usage = Gauge(
            "predictor_kv_cache_usage_ratio",
            "Share of the KV cache's blocks held by running requests (0-1); cached prefixes "
            "no request holds count as free.",
            labels, registry=registry,
        )  # fmt: skip
        self.prefix_cache_queries = Counter(
            "predictor_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (at each request's admission).",
            labels, registry=registry,
        )  # fmt: skip
        self.prefix_cache_hits = Counter(
            "predictor_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not computed).", labels, registry=registry,
        )  # fmt: skip
        self.preemptions = Counter(
            "predictor_num_preemptions",
            "Rows preempted (blocks freed, recomputed later) because the KV cache was full.",
            labels, registry=registry,
        )  # fmt: skip
        self.spec_drafts = Counter(
            "predictor_spec_decode_num_drafts",
            "Speculative decoding: rows that verified draft tokens (one per row and step).",
            labels, registry=registry,
        )  # fmt: skip
        self.spec_draft_tokens = Counter(
            "predictor_spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens verified.", labels, registry=registry,
        )  # fmt: skip
        self.spec_accepted = Counter(
            "predictor_spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted (the model produced them itself).",
            labels, registry=registry,
        )  # fmt: skip
        self.spec_per_position = [
            Counter(
                SPEC_PER_POSITION,
                "Speculative decoding: drafts accepted at each position.",
                [*labels, "position"],
                registry=registry,
            )  # fmt: skip
        ]
        self.cache_config = Gauge(
            "predictor_cache_config_info", "The KV cache's shape (value 1).", _CACHE_LABELS,
            registry=registry,
        )  # fmt: skip
        self.aliases: dict[str, Gauge] = {}
        self.counter_aliases: dict[str, Counter] = {}
        self.vllm_cache_config: Gauge | None = None
        if vllm_aliases:
            for ours, theirs in VLLM_ALIASES.items():
                self.aliases[ours] = Gauge(
                    theirs, f"Same as {ours} (vLLM's name).", ["model_name"], registry=registry
                )
            for ours, theirs in VLLM_COUNTER_ALIASES.items():
                self.counter_aliases[ours] = Counter(
                    theirs, f"Same as {ours} (vLLM's name).", ["model_name"], registry=registry
                )
            self.spec_per_position.append(Counter(
                VLLM_SPEC_PER_POSITION, f"Same as {SPEC_PER_POSITION} (vLLM's name).",
                ["model_name", "position"], registry=registry,
            ))  # fmt: skip
            self.vllm_cache_config = Gauge(
                "vllm:cache_config_info", "Same as predictor_cache_config_info (vLLM's name).",
                _CACHE_LABELS, registry=registry,
            )  # fmt: skip
        # every series a dashboard plots is on /metrics from the start (counters at 0, as vLLM's)
        for collector in (
            self.prefix_cache_queries, self.prefix_cache_hits, self.preemptions, self.ttft,
            self.tpot, self.e2e, self.queue_time, self.batch_size, self.spec_drafts,
            self.spec_draft_tokens, self.spec_accepted, self.wake_ups, self.wake_time,
        ):  # fmt: skip
            collector.labels(model_name)
        self.prompt_tokens.labels(model_name, NO_TENANT)
        self.generation_tokens.labels(model_name, NO_TENANT)
        for alias in self.counter_aliases.values():
            alias.labels(model_name)
        self.loop_tasks = Gauge(
            "predictor_event_loop_tasks", "asyncio tasks alive on the server's event loop.",
            registry=registry,
        )  # fmt: skip
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
        self._track(self.running, "predictor_num_requests_running", running)
        self._track(self.waiting, "predictor_num_requests_waiting", waiting)

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
        self._track(self.kv_cache_usage, "predictor_kv_cache_usage_ratio", usage)

    def describe_cache(self, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        """Publish the KV cache's shape (once, at start)."""
        values = (str(block_size), str(num_blocks), str(prefix_caching))
        self.cache_config.labels(*values).set(1)
        if self.vllm_cache_config is not None:
            self.vllm_cache_config.labels(*values).set(1)

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
            self._count(self.spec_drafts, "predictor_spec_decode_num_drafts", stats.draft_rows)
            self._count(self.spec_draft_tokens, "predictor_spec_decode_num_draft_tokens",
                        stats.draft_tokens)  # fmt: skip
            self._count(self.spec_accepted, "predictor_spec_decode_num_accepted_tokens",
                        stats.accepted_tokens)  # fmt: skip
            for position, accepted in enumerate(stats.accepted_per_position):
                for counter in self.spec_per_position:
                    counter.labels(self.model_name, str(position)).inc(accepted)

    def observe_prefix_cache(self, queried: int, hits: int) -> None:
        """At a request's first admission: its prompt tokens, and how many of them the prefix
        cache held."""
        self._count(self.prefix_cache_queries, "predictor_prefix_cache_queries", queried)
        self._count(self.prefix_cache_hits, "predictor_prefix_cache_hits", hits)

    def observe_preemption(self) -> None:
        self._count(self.preemptions, "predictor_num_preemptions", 1)

    def _count(self, counter: Counter, name: str, amount: int) -> None:
        counter.labels(self.model_name).inc(amount)
        alias = self.counter_aliases.get(name)
        if alias is not None:
            alias.labels(self.model_name).inc(amount)

    def _track(self, gauge: Gauge, name: str, read: Callable[[], float]) -> None:
        gauge.labels(self.model_name).set_function(read)
        alias = self.aliases.get(name)
        if alias is not None:
            alias.labels(self.model_name).set_function(read)

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
            "predictor_kv_offload_bytes", "Bytes of the disk cache's block files now.",
            labels=["model"],
        )  # fmt: skip
        size.add_metric([self._model], self._used())
        yield size
