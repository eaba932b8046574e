"""The requests waiting for a row, in the order they get one: a lower `priority` first (vLLM's:
lower runs sooner, default 0), then the earlier arrival. Adapters add to it from the event loop;
the scheduler takes from it, and puts preempted rows back in their place, on the step loop's
thread."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator

from predictor.engine.request import Request
from predictor.errors import Overloaded


def order(request: Request) -> tuple[int, float]:
    """Who comes first: a lower priority, then the earlier arrival."""
    return request.params.priority, request.arrival


class WaitingQueue:
    """At most `limit` requests queued by clients (a preempted row goes back past it: it was
    admitted once). `lock` (re-entrant) holds the queue still while the scheduler admits."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lock = threading.RLock()
        self._items: list[Request] = []  # in `order`

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._items))

    def add(self, requests: list[Request]) -> None:
        """Queue every one of `requests` or none (Overloaded): a request with several prompts
        is one unit, so a refusal never leaves part of it running."""
        with self.lock:
            if len(self._items) + len(requests) > self.limit:
                more = f", {len(requests)} more do not fit" if len(requests) > 1 else ""
                raise Overloaded(
                    f"server is busy: {len(self._items)} requests already "
                    f"waiting{more}; retry later"
                )
            for request in requests:
                bisect.insort_right(self._items, request, key=order)

    def requeue(self, request: Request) -> None:
        """A preempted row, back in its place (ahead of every later arrival of its priority)."""
        with self.lock:
            bisect.insort_right(self._items, request, key=order)

    def head(self) -> Request | None:
        return self._items[0] if self._items else None

    def pop_head(self) -> Request:
        with self.lock:
            return self._items.pop(0)

    def drop(self, gone: Callable[[Request], bool]) -> list[Request]:
        """Remove and return the requests `gone` says are (aborted, expired, or all)."""
        with self.lock:
            dropped = [r for r in self._items if gone(r)]
            if dropped:
                self._items = [r for r in self._items if not gone(r)]
        return dropped
