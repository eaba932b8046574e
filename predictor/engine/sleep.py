"""Sleep: the model's weights and KV cache freed while the engine is idle, built again for the
next request (llama.cpp's --sleep-idle-seconds; vLLM's POST /sleep and /wake_up).

The step loop (step_loop.py) owns the state and decides when, on its own thread; falling asleep
and waking are done here (`Sleep.fall_asleep`, `Sleep.wake`). Falling asleep puts the running
rows back in the queue (preempted: recomputed after the wake, the same tokens), empties the
prefix cache (an AllBlocksCleared event where KV events are on: the blocks are gone), drops the
runner (the model, its packed kernels' layouts, the KV pools) and calls `release` so the pages
go back to the system; a request that arrives, or a wake-up, builds the runner again with
`reload` and binds it to the thread (the kernels' choices and libraries read back from the
autotune's cache, never measured again) before the next step. Requests that arrive meanwhile
wait in the queue; none fails. No torch here: what a runner is made of is `reload`'s business
(`engine_assembly.py` wires it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from predictor.engine.request import Request
from predictor.engine.scheduler import Scheduler
from predictor.engine.step import Runner
from predictor.types import FinishReason

log = logging.getLogger(__name__)

IDLE = "idle"  # why the engine fell asleep: --sleep-idle-seconds passed with nothing to do
ASKED = "asked"  # POST /sleep


def _nothing() -> None:
    pass


def _keep(_: Runner) -> None:
    pass


@dataclass(frozen=True)
class Sleep:
    """How a step loop sleeps and wakes."""

    # a new runner for the same model, as the start built it (not yet bound to a thread)
    reload: Callable[[], Runner]
    # called with the runner before it is dropped: its tensors emptied, whoever else holds them
    free: Callable[[Runner], None] = _keep
    # called once the runner is dropped: the freed memory back to the system (the collector
    # run, the heap trimmed)
    release: Callable[[], None] = _nothing
    # seconds with no request running or waiting before the engine sleeps (0: only when asked)
    idle_seconds: float = 0.0
    # called before the prefix cache is emptied, no row holding a block: what should outlive
    # the sleep is kept (the disk prefix cache saves the cached blocks)
    keep: Callable[[], None] = _nothing

    def due(self, idle_for: float) -> bool:
        """Whether an engine idle for `idle_for` seconds should fall asleep now."""
        return self.idle_seconds > 0 and idle_for >= self.idle_seconds

    def fall_asleep(
        self,
        scheduler: Scheduler,
        take_runner: Callable[[], Runner],
        clock: Callable[[], float],
        reason: str,
    ) -> list[Request]:
        """Free the runner and everything the KV cache held (its blocks are the runner's pools):
        the running rows preempted (returned), the prefix cache emptied (AllBlocksCleared), the
        runner `take_runner` hands over freed and dropped, the memory released. `take_runner`
        hands the loop's runner over so that this frame holds its last reference."""
        started = time.perf_counter()
        suspended = scheduler.preempt_all()
        now = clock()
        for request in suspended:
            request.preempted_at.append(now)
        self.keep()  # before the cached blocks go
        scheduler.reset_prefix_cache()  # no row holds a block now: always done
        if scheduler.events is not None:
            scheduler.events.flush()
        runner = take_runner()
        self.free(runner)
        del runner  # the last reference: the collector finds what only cycles hold
        self.release()
        log.info(
            "asleep (%s): the model and its KV cache freed in %.2f s, %d rows to recompute",
            reason,
            time.perf_counter() - started,
            len(suspended),
        )
        return suspended

    def wake(self, scheduler: Scheduler) -> Runner | None:
        """A new runner, built and bound to the calling thread (the requests meanwhile wait in
        the queue); where that fails, None: the waiting requests fail with the reason and the
        engine stays asleep (the next request tries again)."""
        started = time.perf_counter()
        try:
            runner = self.reload()
            runner.bind_thread()
        except Exception:
            log.exception("waking up: the model could not be loaded again")
            for request in scheduler.drain():
                request.finish(FinishReason.ERROR, error="the model could not be loaded again")
            return None
        log.info("awake: the model loaded again in %.2f s", time.perf_counter() - started)
        return runner
