"""Who runs next: waiting requests join the batch within a row limit and the KV-cache blocks."""

from __future__ import annotations

import threading
from collections import deque

from predictor.engine.batch import Sequence
from predictor.engine.kv_cache import BlockAllocator, blocks_for
from predictor.errors import Overloaded


class Scheduler:
    """First come, first served. Thread-safe: adapters add from the event loop thread, the step
    loop takes from its own thread."""

    def __init__(self, max_batch_size: int, max_waiting: int) -> None:
        self.max_batch_size = max_batch_size
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

    def add_all(self, seqs: list[Sequence]) -> None:
        """Queue every one of `seqs` or none (Overloaded): a request with several prompts is one
        unit, so a refusal never leaves part of it running."""
        with self._lock:
            if len(self._waiting) + len(seqs) > self.max_waiting:
                raise Overloaded(
                    f"server is busy: {len(self._waiting)} requests already waiting, "
                    f"{len(seqs)} more do not fit; retry later"
                )
            self._waiting.extend(seqs)

    def waiting(self) -> int:
        return len(self._waiting)

    def drop_aborted(self) -> list[Sequence]:
        """Remove and return waiting requests that were aborted before they got a row."""
        with self._lock:
            gone = [s for s in self._waiting if s.aborted]
            if gone:
                self._waiting = deque(s for s in self._waiting if not s.aborted)
        return gone

    def drop_expired(self, now: float) -> list[Sequence]:
        """Remove and return waiting requests whose deadline passed before they got a row."""
        with self._lock:
            gone = [s for s in self._waiting if s.deadline is not None and now >= s.deadline]
            if gone:
                self._waiting = deque(s for s in self._waiting if s not in gone)
        return gone

    def admit(self, running_rows: int, cache: BlockAllocator) -> list[Sequence]:
        """Take waiting requests, oldest first, while rows and KV-cache blocks allow.

        Each admitted request reserves the blocks its prompt and max_tokens may fill, so it can
        never run out of cache later (the engine refuses a request larger than the whole cache).
        """
        admitted: list[Sequence] = []
        with self._lock:
            while self._waiting and running_rows + len(admitted) < self.max_batch_size:
                seq = self._waiting[0]
                need = blocks_for(seq.budget_tokens, cache.block_size)
                if not cache.can_reserve(need):
                    break
                cache.reserve(need)
                seq.reserved_blocks = need
                admitted.append(self._waiting.popleft())
        return admitted

    def drain(self) -> list[Sequence]:
        """Remove and return every waiting request."""
        with self._lock:
            gone = list(self._waiting)
            self._waiting.clear()
        return gone
