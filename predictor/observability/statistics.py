"""Cumulative inference statistics in Triton's terms (ModelStatistics), from what is measured.

Fed by `Metrics`: `record_request` when a request's event stream ends (the event loop),
`record_queue` and `record_execution` from the step loop thread; a lock guards the sums.

- success / fail: requests that reached the engine and ended normally (length, end of sequence,
  stop string) / otherwise (refused by the engine, error, timeout, cancelled), with their
  durations from the engine call to the last event. Requests refused while parsing never reach
  the engine and are not counted, as Triton counts only requests it queued.
- queue: each admitted request's wait for a batch row (the step loop measures it).
- compute_input: arrival to the first token less the queue wait (tokenization and prefill);
  compute_infer: first to last token (decode); compute_output: last token to the final event.
  Counted for every request that produced a token; the queue wait is subtracted as a sum.
- inference_count: successful requests; execution_count: engine steps that produced tokens, each
  one forward pass over every running request (continuous batching: many requests share an
  execution; the pass that finishes a prompt's prefill makes its first token).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

_NS = 1_000_000_000


@dataclass(frozen=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> Duration:
        return Duration(self.count + 1, self.ns + max(0, round(seconds * _NS)))


@dataclass(frozen=True)
class StatisticsSnapshot:
    last_inference_ms: int
    inference_count: int
    execution_count: int
    success: Duration
    fail: Duration
    queue: Duration
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


@dataclass(frozen=True)
class RequestTiming:
    """One request, in seconds from its start; None where it never got that far."""

    succeeded: bool
    total: float
    first_token: float | None = None
    last_token: float | None = None


class InferenceStatistics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ms = 0
        self._executions = 0
        self._success = Duration()
        self._fail = Duration()
        self._queue = Duration()
        self._to_first = Duration()  # arrival to first token, queue included
        self._infer = Duration()
        self._output = Duration()

    def record_request(self, timing: RequestTiming) -> None:
        with self._lock:
            self._last_ms = int(time.time() * 1000)
            if timing.succeeded:
                self._success = self._success.add(timing.total)
            else:
                self._fail = self._fail.add(timing.total)
            if timing.first_token is not None and timing.last_token is not None:
                self._to_first = self._to_first.add(timing.first_token)
                self._infer = self._infer.add(timing.last_token - timing.first_token)
                self._output = self._output.add(timing.total - timing.last_token)

    def record_queue(self, seconds: float) -> None:
        with self._lock:
            self._queue = self._queue.add(seconds)

    def record_execution(self) -> None:
        with self._lock:
            self._executions += 1

    def snapshot(self) -> StatisticsSnapshot:
        with self._lock:
            compute_input = Duration(
                self._to_first.count, max(0, self._to_first.ns - self._queue.ns)
            )
            return StatisticsSnapshot(
                last_inference_ms=self._last_ms,
                inference_count=self._success.count,
                execution_count=self._executions,
                success=self._success,
                fail=self._fail,
                queue=self._queue,
                compute_input=compute_input,
                compute_infer=self._infer,
                compute_output=self._output,
            )
