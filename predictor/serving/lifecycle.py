"""Graceful drain: what SIGTERM (and SIGINT) does to a running server.

At once: readiness turns false and new requests get 503. Requests in flight may finish within
the grace period; whatever is left then ends with an error. Then the REST and gRPC servers stop
and the process exits 0. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import FrameType

from kserve.protocol.dataplane import DataPlane

from predictor.engine.client import EngineClient

log = logging.getLogger(__name__)


class PredictorDataPlane(DataPlane):
    """KServe's data plane, telling the truth about health.

    Ready: not draining, at least one model registered, and every model ready (its engine
    accepting work: false once unloaded, stopped, dead or hung). Live: every model's engine is
    live (`EngineClient.live`: the step thread runs and makes progress when it has work).
    """

    draining = False

    async def ready(self) -> bool:
        if self.draining or not await super().ready():
            return False
        registry = self.model_registry
        names = list(registry.get_models())
        return bool(names) and all([await registry.is_model_ready(n) for n in names])

    async def live(self) -> dict[str, str]:
        models = self.model_registry.get_models().values()
        engines = [m.llm for m in models if hasattr(m, "llm")]
        if all(engine.live() for engine in engines):
            return {"status": "alive"}
        return {"status": "stalled: the engine's step loop died or makes no progress"}


class Drain:
    def __init__(
        self,
        dataplane: PredictorDataPlane,
        engines: Callable[[], list[EngineClient]],
        grace_seconds: float,
        stop_servers: Callable[[bool], Awaitable[None]],
    ) -> None:
        self._dataplane = dataplane
        self._engines = engines
        self._grace = grace_seconds
        self._stop_servers = stop_servers  # called with force=True on a second signal
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._forced = False

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def on_signal(self, signum: int, frame: FrameType | None = None) -> None:
        """A signal handler (runs on the main thread, where the event loop runs)."""
        if self._loop is None:
            raise SystemExit(0)  # not serving yet: nothing to drain
        self._loop.call_soon_threadsafe(self._begin, signum)

    def _begin(self, signum: int) -> None:
        if self._task is None:
            log.info("signal %d: draining for up to %.0f s", signum, self._grace)
            self._task = asyncio.ensure_future(self._drain())
        elif not self._forced:
            log.info("signal %d again: stopping now", signum)
            self._forced = True
            asyncio.ensure_future(self._finish(force=True))

    async def _drain(self) -> None:
        self._dataplane.draining = True
        engines = self._engines()
        for engine in engines:
            engine.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._grace
        while not self._forced and loop.time() < deadline:
            if not any(e.running() or e.waiting() for e in engines):
                break
            await asyncio.sleep(0.05)
        if not self._forced:
            await self._finish(force=False)

    async def _finish(self, force: bool) -> None:
        for engine in self._engines():
            engine.stop()  # ends what is left with an error event
        await asyncio.sleep(0.1)  # let the last events reach their streams
        await self._stop_servers(force)
