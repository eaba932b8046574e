"""Every request's event stream passes through here once: metrics, the trace span, the payload
record. `Observer.observe` wraps the engine's stream (`serving/model.py` is the only caller);
what the transport carried (trace context, tenant header) is read from `context.py`.

Per token only counters and histograms move; the span and the payload record are built once, when
the stream closes, and handed to their export threads (`tracing.py`, `payloads.py`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from predictor.engine.client import Stream
from predictor.errors import PredictorError, status_of
from predictor.observability import context
from predictor.observability.metrics import Metrics
from predictor.observability.payloads import PayloadLog, payload_field, prompt_text
from predictor.observability.statistics import RequestTiming
from predictor.observability.tenants import TenantLabels
from predictor.observability.tracing import SpanRecord, Tracing
from predictor.types import FinishReason, GenerateRequest, RequestTimes, TokenEvent, Usage

_SUCCEEDED = {FinishReason.LENGTH.value, FinishReason.EOS.value, FinishReason.STOP.value}
_NS = 1_000_000_000
DEFAULT_MAX_TENANTS = 64


class Observer:
    """The server's observability, built once at start (`__main__`): Prometheus metrics, and
    when configured traces and payload records."""

    def __init__(
        self,
        metrics: Metrics,
        tenants: TenantLabels | None = None,
        tracing: Tracing | None = None,
        payloads: PayloadLog | None = None,
    ) -> None:
        self.metrics = metrics
        self.tenants = tenants or TenantLabels(DEFAULT_MAX_TENANTS)
        self.tracing = tracing
        self.payloads = payloads

    def observe(
        self, events: Stream, protocol: str, request: GenerateRequest | None = None
    ) -> ObservedStream:
        """Pass a request's events through, timing, counting and (when on) tracing them."""
        return ObservedStream(self, events, protocol, request)

    async def rejected(
        self, requests: Sequence[GenerateRequest], protocol: str, error: PredictorError
    ) -> None:
        """Requests the engine refused as one unit before any stream existed: counted, traced
        and recorded as a stream that failed at once would be."""
        for request in requests:
            observed = ObservedStream(self, _Refused(error), protocol, request)
            with contextlib.suppress(PredictorError):
                await observed.__anext__()

    def close(self) -> None:
        """Send what is queued (bounded waits) and stop the export threads."""
        if self.tracing is not None:
            self.tracing.flush(5.0)
            self.tracing.shutdown()
        if self.payloads is not None:
            self.payloads.flush(5.0)
            self.payloads.shutdown()


class _Refused:
    """The stream of a request refused before it had one: its first event is the error."""

    def __init__(self, error: PredictorError) -> None:
        self._error = error

    def __aiter__(self) -> _Refused:
        return self

    async def __anext__(self) -> TokenEvent:
        raise self._error

    async def aclose(self) -> None:
        pass


@dataclass
class _Seen:
    """What a stream's events said, for its span and payload record."""

    text: list[str] = field(default_factory=list)
    usage: Usage | None = None
    times: RequestTimes | None = None
    error: str | None = None


class ObservedStream:
    """A request's events, measured. A class rather than an async generator: closing it closes
    the engine's stream (aborting the request) even if it was never iterated."""

    def __init__(
        self, observer: Observer, events: Stream, protocol: str, request: GenerateRequest | None
    ) -> None:
        self._observer = observer
        self._events = events
        self._protocol = protocol
        self._request = request
        meta = context.current()
        self._trace = meta.trace
        self._tenant = meta.tenant or (request.tenant if request is not None else None)
        self._label = observer.tenants.label(self._tenant)
        self._wall = time.time_ns()
        self._start = self._last = time.monotonic()
        self._first_token: float | None = None
        self._end: float | None = None
        self._reason = "cancelled"
        self._counted = False
        self._seen = _Seen()
        self._keep_text = observer.payloads is not None

    def __aiter__(self) -> ObservedStream:
        return self

    async def __anext__(self) -> TokenEvent:
        m = self._observer.metrics
        model = m.model_name
        try:
            event = await self._events.__anext__()
        except PredictorError as exc:
            self._reason = "rejected"
            self._seen.error = str(exc) if status_of(exc).client_fault else type(exc).__name__
            await self.aclose()
            raise
        except BaseException:
            await self.aclose()
            raise
        now = time.monotonic()
        if event.token_ids:
            hist = m.ttft if self._first_token is None else m.tpot
            hist.labels(model).observe(now - self._last)
            m.generation_tokens.labels(model, self._label).inc(len(event.token_ids))
            self._first_token = now if self._first_token is None else self._first_token
            self._last = now
        if self._keep_text and event.text:
            self._seen.text.append(event.text)
        if event.final and event.finish_reason is not None:
            self._reason, self._end = event.finish_reason.value, now
            m.e2e.labels(model).observe(now - self._start)
            self._seen.usage, self._seen.times = event.usage, event.times
            self._seen.error = event.error
            if event.usage is not None:
                m.prompt_tokens.labels(model, self._label).inc(event.usage.prompt_tokens)
        return event

    async def aclose(self) -> None:
        if not self._counted:
            self._counted = True
            self._count()
            self._export()
        await self._events.aclose()

    def _count(self) -> None:
        m = self._observer.metrics
        m.requests.labels(m.model_name, self._protocol, self._reason, self._label).inc()
        first = self._first_token
        timing = RequestTiming(
            self._reason in _SUCCEEDED,
            (self._end or time.monotonic()) - self._start,
            None if first is None else first - self._start,
            None if first is None else self._last - self._start,
        )
        m.statistics.record_request(timing)

    def _export(self) -> None:
        observer = self._observer
        if self._request is None or (observer.tracing is None and observer.payloads is None):
            return
        latency = self._latency()
        trace_id = None
        if observer.tracing is not None:
            trace_id = observer.tracing.record(self._span(latency))
        if observer.payloads is not None:
            observer.payloads.submit(self._record(latency, observer.payloads.mode, trace_id))

    def _latency(self) -> dict[str, float]:
        """vLLM's request latencies, in seconds (those that apply)."""
        end = self._end or time.monotonic()
        first, times = self._first_token, self._seen.times
        scheduled = None if times is None else times.scheduled
        out = {"e2e": end - self._start}
        if scheduled is not None and times is not None:
            out["time_in_queue"] = max(0.0, scheduled - times.arrival)
        if first is not None:
            out["time_to_first_token"] = first - self._start
            out["time_in_model_decode"] = self._last - first
            if scheduled is not None:
                out["time_in_model_prefill"] = max(0.0, first - scheduled)
        return out

    def _at(self, monotonic: float) -> int:
        return self._wall + int((monotonic - self._start) * _NS)

    def _span(self, latency: dict[str, float]) -> SpanRecord:
        request = self._request
        assert request is not None
        model = self._observer.metrics.model_name
        operation = "chat" if request.chat else "text_completion"
        p = request.params
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model,
            "gen_ai.response.model": model,
            "gen_ai.request.id": request.request_id,
            "gen_ai.response.id": request.request_id,
            "gen_ai.request.max_tokens": p.max_tokens,
            "gen_ai.request.temperature": p.temperature,
            "gen_ai.request.top_p": p.top_p,
            "gen_ai.request.top_k": p.top_k,
            "gen_ai.request.presence_penalty": p.presence_penalty,
            "gen_ai.request.frequency_penalty": p.frequency_penalty,
            "gen_ai.response.finish_reasons": [self._reason],
            "predictor.protocol": self._protocol,
            "predictor.tenant": self._label,
        }
        if p.seed is not None:
            attributes["gen_ai.request.seed"] = p.seed
        if p.stop:
            attributes["gen_ai.request.stop_sequences"] = list(p.stop)
        usage = self._seen.usage
        if usage is not None:
            attributes["gen_ai.usage.input_tokens"] = usage.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = usage.generated_tokens
            attributes["gen_ai.usage.cache_read.input_tokens"] = usage.cached_tokens
        attributes.update({f"gen_ai.latency.{k}": v for k, v in latency.items()})
        end = self._end or time.monotonic()
        events: list[tuple[str, int, dict[str, Any]]] = []
        times = self._seen.times
        for i, at in enumerate(() if times is None else times.preempted):
            events.append(("preempted", self._at(at), {"predictor.preemption": i + 1}))
        events.append(("finish", self._at(end), {"gen_ai.response.finish_reason": self._reason}))
        failed = self._reason in ("rejected", FinishReason.ERROR.value)
        return SpanRecord(
            f"{operation} {model}",
            self._wall,
            self._at(end),
            self._trace,
            attributes,
            events,
            (self._seen.error or self._reason) if failed else None,
        )

    def _record(self, latency: dict[str, float], mode: str, trace_id: str | None) -> dict[str, Any]:
        request = self._request
        assert request is not None
        usage = self._seen.usage
        asked = prompt_text(request.prompt, request.messages, request.prompt_ids)
        p = request.params
        return {
            "id": request.request_id,
            "model": self._observer.metrics.model_name,
            "protocol": self._protocol,
            "tenant": self._tenant,
            "trace_id": trace_id,
            "time": self._wall / _NS,
            "parameters": {
                "max_tokens": p.max_tokens,
                "temperature": p.temperature,
                "top_p": p.top_p,
                "top_k": p.top_k,
                "seed": p.seed,
                "stop": list(p.stop),
                "grammar": None if p.grammar is None else p.grammar.kind,
                "tools": request.tools is not None,
            },
            "prompt": payload_field(asked, mode),
            "response": payload_field("".join(self._seen.text), mode),
            "usage": None
            if usage is None
            else {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.generated_tokens,
                "cached_tokens": usage.cached_tokens,
            },
            "latency": latency,
            "finish_reason": self._reason,
            "error": self._seen.error,
        }
