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

    def requeue(self, seq: Sequence) -> None:
        """Put a preempted row back at the head of the queue (past the waiting limit: it was
        admitted once); preempting newest first and requeueing each at the head keeps the
        older ones first."""
        with self._lock:
            self._waiting.appendleft(seq)

    def admit(
        self, running_rows: int, cache: BlockAllocator, prefix_caching: bool = True
    ) -> list[Sequence]:
        """Take waiting requests, oldest first, while rows and KV-cache blocks allow.

        A request takes the blocks of its longest cached prefix (never its last token: that
        one's logits are needed) and new blocks for the rest of its prompt, when that leaves a
        small headroom for the running rows to grow into (none needed by a lone request). A
        request whose prompt must be scored (prompt_logprobs) takes no cached prefix, as vLLM
        does: every position it scores is computed. Its
        output later grows one block at a time; the step loop preempts when none is left.
        """
        admitted: list[Sequence] = []
        size = cache.block_size
        headroom = max(1, cache.num_blocks // 100)  # vLLM's watermark: 1% of the blocks
        with self._lock:
            while self._waiting and running_rows + len(admitted) < self.max_batch_size:
                seq = self._waiting[0]
                total = seq.total_tokens
                hit: list[int] = []
                if prefix_caching and not seq.scoring:  # scored positions are computed
                    hit = cache.match(seq.block_keys((total - 1) // size, size))
                new = blocks_for(total, size) - len(hit)
                spare = headroom if running_rows + len(admitted) else 0
                if cache.available - cache.unheld(hit) < new + spare:
                    break
                cache.share(hit)
                # room to grow adjacent: the output's blocks, up to 16 of them
                grow = blocks_for(min(seq.params.max_tokens, 16 * size), size)
                seq.blocks = hit + cache.allocate(new, claim=new + grow)
                seq.cached = len(hit) * size
                seq.registered = len(hit)
                if not seq.preemptions:
                    seq.cached_prompt_tokens = seq.cached
                admitted.append(self._waiting.popleft())
        return admitted

    def drain(self) -> list[Sequence]:
        """Remove and return every waiting request."""
        with self._lock:
            gone = list(self._waiting)
            self._waiting.clear()
        return gone
