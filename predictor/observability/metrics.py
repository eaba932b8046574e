"""Every Prometheus collector, created once against a registry passed in.

Served on KServe's `/metrics` (the default registry) by `python -m predictor`; tests pass their
own registry. REST and gRPC, unary and streaming, are counted alike: each path wraps its event
stream in `observe`.

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
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from predictor.engine.client import Stream
from predictor.errors import PredictorError
from predictor.observability.statistics import InferenceStatistics, RequestTiming
from predictor.types import FinishReason, TokenEvent

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128)
_SUCCEEDED = {FinishReason.LENGTH.value, FinishReason.EOS.value, FinishReason.STOP.value}


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
}
_CACHE_LABELS = ["block_size", "num_gpu_blocks", "enable_prefix_caching"]


class Metrics:
    def __init__(
        self, registry: CollectorRegistry, model_name: str, vllm_aliases: bool = False
    ) -> None:
        self.model_name = model_name
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
            "predictor_prompt_tokens", "Prompt tokens of finished requests.", labels,
            registry=registry,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "predictor_generation_tokens", "Tokens generated.", labels, registry=registry
        )
        self.requests = Counter(
            "predictor_requests", "Requests by protocol and finish reason.",
            ["model", "protocol", "finish_reason"], registry=registry,
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
            self.vllm_cache_config = Gauge(
                "vllm:cache_config_info", "Same as predictor_cache_config_info (vLLM's name).",
                _CACHE_LABELS, registry=registry,
            )  # fmt: skip
        for counter in (self.prefix_cache_queries, self.prefix_cache_hits, self.preemptions):
            counter.labels(model_name)  # on /metrics at 0 from the start, as vLLM's are
        for alias in self.counter_aliases.values():
            alias.labels(model_name)
        self.loop_tasks = Gauge(
            "predictor_event_loop_tasks", "asyncio tasks alive on the server's event loop.",
            registry=registry,
        )  # fmt: skip
        self.loop_tasks.set_function(_event_loop_tasks)
        self.statistics = InferenceStatistics()  # Triton's ModelStatistics, from the same events

    def track_engine(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        self._track(self.running, "predictor_num_requests_running", running)
        self._track(self.waiting, "predictor_num_requests_waiting", waiting)

    def track_kv_cache(self, usage: Callable[[], float]) -> None:
        """`usage`: the fraction of the KV-cache budget in use now, read at each scrape."""
        self._track(self.kv_cache_usage, "predictor_kv_cache_usage_ratio", usage)

    def describe_cache(self, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        """Publish the KV cache's shape (once, at start)."""
        values = (str(block_size), str(num_blocks), str(prefix_caching))
        self.cache_config.labels(*values).set(1)
        if self.vllm_cache_config is not None:
            self.vllm_cache_config.labels(*values).set(1)

    def observe_prefix_cache(self, queried: int, hits: int) -> None:
        """Called by the step loop at a request's first admission: its prompt tokens, and how
        many of them the prefix cache held."""
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
        """Called by the step loop after each step that produced tokens, with their number."""
        self.batch_size.labels(self.model_name).observe(rows)
        self.statistics.record_execution()

    def observe_queue(self, seconds: float) -> None:
        """Called by the step loop when a request gets its row."""
        self.queue_time.labels(self.model_name).observe(seconds)
        self.statistics.record_queue(seconds)

    def observe(self, events: Stream, protocol: str) -> ObservedStream:
        """Pass a request's events through, timing and counting them."""
        return ObservedStream(self, events, protocol)


class ObservedStream:
    """A request's events, measured. A class rather than an async generator: closing it closes
    the engine's stream (aborting the request) even if it was never iterated."""

    def __init__(self, metrics: Metrics, events: Stream, protocol: str) -> None:
        self._metrics = metrics
        self._events = events
        self._protocol = protocol
        self._start = self._last = time.monotonic()
        self._first_token: float | None = None
        self._end: float | None = None
        self._reason = "cancelled"
        self._counted = False

    def __aiter__(self) -> ObservedStream:
        return self

    async def __anext__(self) -> TokenEvent:
        m, model = self._metrics, self._metrics.model_name
        try:
            event = await self._events.__anext__()
        except PredictorError:
            self._reason = "rejected"
            await self.aclose()
            raise
        except BaseException:
            await self.aclose()
            raise
        now = time.monotonic()
        if event.token_ids:
            hist = m.ttft if self._first_token is None else m.tpot
            hist.labels(model).observe(now - self._last)
            m.generation_tokens.labels(model).inc(len(event.token_ids))
            self._first_token = now if self._first_token is None else self._first_token
            self._last = now
        if event.final and event.finish_reason is not None:
            self._reason, self._end = event.finish_reason.value, now
            m.e2e.labels(model).observe(now - self._start)
            if event.usage is not None:
                m.prompt_tokens.labels(model).inc(event.usage.prompt_tokens)
        return event

    async def aclose(self) -> None:
        if not self._counted:
            self._counted = True
            m = self._metrics
            m.requests.labels(m.model_name, self._protocol, self._reason).inc()
            first = self._first_token
            timing = RequestTiming(
                self._reason in _SUCCEEDED,
                (self._end or time.monotonic()) - self._start,
                None if first is None else first - self._start,
                None if first is None else self._last - self._start,
            )
            m.statistics.record_request(timing)
        await self._events.aclose()
