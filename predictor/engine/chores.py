"""Work run on the step loop's thread between two steps, a slice at a time (StepLoop.run_chore).

A chore is a generator that yields between its slices and returns its result (a LoRA adapter's
read, `model/lora.py` reading_adapter, and its layouts, `LoraWeights.adding`). Work done on
another thread while steps run (hundreds of torch ops for an adapter) takes the GIL at each of
its ops from the step thread and from the event loop that delivers the tokens; sliced between
steps, a step waits at most one slice (a few milliseconds) and nothing else waits. Thread-safe:
any thread submits, the loop's thread runs the slices.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator
from concurrent.futures import Future
from typing import Any

# yields between slices; its return value (StopIteration's) is the result
Chore = Generator[None, None, Any]


class Chores:
    def __init__(self) -> None:
        self._queue: deque[tuple[Chore, Future[Any]]] = deque()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def submit(self, chore: Chore) -> Future[Any]:
        """Queue `chore`; its future gets the result, or what it raised."""
        future: Future[Any] = Future()
        self._queue.append((chore, future))
        return future

    def run_slice(self) -> None:
        """One slice of the oldest chore (the loop's thread)."""
        chore, future = self._queue[0]
        try:
            next(chore)
        except StopIteration as done:
            self._queue.popleft()
            future.set_result(done.value)
        except BaseException as exc:  # the submitter's to handle
            self._queue.popleft()
            future.set_exception(exc)

    def fail_all(self, message: str) -> None:
        """Every chore not finished: its submitter is told (the loop stops)."""
        while self._queue:
            self._queue.popleft()[1].set_exception(RuntimeError(message))
