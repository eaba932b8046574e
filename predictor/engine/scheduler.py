"""Who runs next: waiting requests join the batch within a row limit and a cache-token budget."""

from __future__ import annotations

import threading
from collections import deque

from predictor.engine.batch import Sequence
from predictor.errors import Overloaded


class Scheduler:
    """First come, first served. Thread-safe: adapters add from the event loop thread, the step
    loop takes from its own thread."""

    def __init__(self, max_batch_size: int, max_cache_tokens: int, max_waiting: int) -> None:
        self.max_batch_size = max_batch_size
        self.max_cache_tokens = max_cache_tokens
        self.max_waiting = max_waiting
        self._waiting: deque[Sequence] = deque()
        self._lock = threading.Lock()

    def add(self, seq: Sequence) -> None:
        with self._lock:
            if len(self._waiting) >= self.max_waiting:
                raise Overloaded(
                    f"server is busy: {len(self._waiting)} requests already waiting; retry later"
                )
            self._waiting.append(seq)

    def waiting(self) -> int:
        return len(self._waiting)

    def drop_aborted(self) -> list[Sequence]:
        """Remove and return waiting requests that were aborted before they got a row."""
        with self._lock:
            gone = [s for s in self._waiting if s.aborted]
            if gone:
                self._waiting = deque(s for s in self._waiting if not s.aborted)
        return gone

    def admit(self, running_rows: int, running_tokens: int) -> list[Sequence]:
        """Take waiting requests, oldest first, while rows and the token budget allow.

        A request larger than the whole budget is still admitted into an empty batch, so it
        cannot wait forever (its size was already checked against the context length).
        """
        admitted: list[Sequence] = []
        with self._lock:
            while self._waiting and running_rows + len(admitted) < self.max_batch_size:
                seq = self._waiting[0]
                fits = running_tokens + seq.budget_tokens <= self.max_cache_tokens
                if not fits and (running_rows or admitted):
                    break
                admitted.append(self._waiting.popleft())
                running_tokens += seq.budget_tokens
        return admitted

    def drain(self) -> list[Sequence]:
        """Remove and return every waiting request."""
        with self._lock:
            gone = list(self._waiting)
            self._waiting.clear()
        return gone
