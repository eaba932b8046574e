"""Where a start's seconds went, logged once when the engine is ready: a pod that scales from
zero or restarts makes its users wait that long, so each phase is named (imports, the
checkpoint's load, the engine's set-up, the kernels: compiled, chosen and built)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger("predictor")


def process_age() -> float:
    """Seconds since this process started (its imports included); 0 where /proc cannot say."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime: ticks since boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


class StartupClock:
    """Phases marked as they end, in order; `ready` logs them with the total."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, age: float | None = None):
        self._clock = clock
        self._started = clock() - (process_age() if age is None else age)
        self._last = self._started
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = self._clock()
        self.phases.append((phase, now - self._last))
        self._last = now

    def ready(self) -> None:
        self.mark("kernels")
        total = self._last - self._started
        spans = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases)
        logger.info("ready after %.1f s: %s", total, spans)
