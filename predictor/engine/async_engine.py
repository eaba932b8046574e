"""The asyncio front of the engine: one queue per request, admission, the thread bridge.

Events cross from the step loop thread to the event loop in one place only: the sink made in
`_request` collects each step's events, and `_after_step` (the step loop's listener, run after
each step) hands them over with one `loop.call_soon_threadsafe` per step, not one per row. The
step's stats reach the engine only through that listener, and go on to `on_step` (metrics).

What the step thread does is read only through its published `StepLoop.status()` (rows,
queue, KV usage, the adapters in use, its last progress); requests reach it through
`StepLoop.add_all`. Templating, tokenizing and the checks are the input processor's
(engine/input_processor.py), run in a worker thread; LoRA residency is engine/adapters.py's. A
request with several prompts is one unit (`generate_all`): admitted whole or refused whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from predictor.engine.adapters import Adapters
from predictor.engine.input_processor import InputProcessor, Limits, Tokenizer
from predictor.engine.reasoning import ReasoningFormat
from predictor.engine.request import Request
from predictor.engine.step import StepStats
from predictor.engine.step_loop import StepLoop
from predictor.errors import EngineUnavailable, InvalidRequest, ModelMissing
from predictor.types import GenerateRequest, TokenEvent


class AsyncEngine:
    """Implements `EngineClient` and `AdapterAdmin` over a `StepLoop`."""

    def __init__(
        self,
        step_loop: StepLoop,
        tokenizer: Tokenizer,
        *,
        max_tokens_limit: int,
        max_prompt_tokens: int,
        default_timeout: float | None = None,
        max_prompts: int = 16,
        stall_seconds: float = 120.0,
        grammar_timeout: float = 10.0,
        max_grammar_compiles: int = 16,
        on_step: Callable[[StepStats], None] | None = None,
        adapters: Adapters | None = None,
        on_stop: Callable[[], None] | None = None,
        reasoning: ReasoningFormat | None = None,
        reasoning_budget: int | None = None,
    ) -> None:
        self._loop = step_loop
        self._on_stop = on_stop  # after the step loop stops (the KV events' publisher closed)
        limits = Limits(max_tokens_limit, max_prompt_tokens, max_prompts, *step_loop.kv_blocks)
        self.inputs = InputProcessor(
            tokenizer,
            limits,
            step_loop.eos_ids,
            grammar_timeout,
            max_grammar_compiles,
            adapters,
            reasoning,
            reasoning_budget,
        )
        self.stall_seconds = stall_seconds
        self._default_timeout = default_timeout
        self._on_step = on_step  # the step stats' next reader (metrics)
        self._adapters = adapters  # LoRA adapters by name (None: the server serves none)
        self._live: dict[int, Request] = {}  # the event loop's own: read on no other thread
        self._preparing = 0  # requests being tokenized: in flight, not yet in the scheduler
        # this step's events, appended and flushed on the step loop thread only
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[TokenEvent], TokenEvent]]
        self._outbox = []
        self._keys = itertools.count()
        self._accepting = True
        self._started = False
        self._stopped = False

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._started = True
        self._loop.start(self._after_step)

    def drain(self) -> None:
        """Refuse new requests (EngineUnavailable); the ones in flight go on."""
        self._accepting = False

    def stop(self) -> None:
        """Stop the step loop; requests still in flight end with an error."""
        self._accepting = False
        self._stopped = True
        self._loop.stop()
        self.inputs.close()
        if self._on_stop is not None:
            self._on_stop()

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's POST /reset_prefix_cache): False, nothing done,
        while a row holds blocks."""
        return await asyncio.to_thread(self._loop.reset_prefix_cache)

    async def sleep(self) -> None:
        """Free the model's weights and KV cache now (vLLM's POST /sleep); the running requests
        are recomputed once the engine wakes, which a waiting or new request does at once
        (InvalidRequest where this engine cannot sleep)."""
        if not await asyncio.to_thread(self._loop.sleep):
            raise InvalidRequest(
                "this server cannot sleep: sleep frees the CPU runner's model and serves no "
                "LoRA adapters (docs/deployment.md, Sleep)"
            )

    async def wake_up(self) -> None:
        """Load the model again now if it sleeps (vLLM's POST /wake_up); EngineUnavailable
        where it cannot be loaded."""
        if not await asyncio.to_thread(self._loop.wake_up):
            raise EngineUnavailable("the model could not be loaded again; the log says why")

    def is_sleeping(self) -> bool:
        """Whether the model's weights and KV cache are freed now (vLLM's GET /is_sleeping)."""
        return self._loop.sleeping()

    def live(self) -> bool:
        """False when the step thread died without being stopped, or rows are running and no
        step has completed for `stall_seconds` (a hung kernel): the process should restart."""
        if self._stopped:
            return True  # stopped on purpose (drain, unload): readiness says so, not liveness
        if self._started and not self._loop.alive():
            return False
        status = self._loop.status()
        stalled = time.monotonic() - status.progress > self.stall_seconds
        return not (status.running and stalled)

    def health(self) -> bool:
        """Accepting requests, the step thread alive and making progress."""
        return self._accepting and self._loop.alive() and self.live()

    def ready(self) -> bool:
        """Healthy, and the runner prepared on the step thread (its kernels compiled and tuned):
        requests sent before then are queued, and wait for it."""
        return self._loop.prepared.is_set() and self.health()

    def running(self) -> int:
        """Requests holding a batch row (those being prefilled too)."""
        return self._loop.status().running

    def waiting(self) -> int:
        """Requests waiting for a batch row, counting those still being tokenized."""
        return self._loop.waiting() + self._preparing

    # -- requests -----------------------------------------------------------------------------
    async def tokenize(self, request: GenerateRequest) -> list[int]:
        return await asyncio.to_thread(self.inputs.encode_prompt, request)

    async def detokenize(self, ids: Sequence[int]) -> str:
        self.inputs.check_ids(ids, "tokens")
        return await asyncio.to_thread(self.inputs.tokenizer.decode, list(ids))

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        (stream,) = await self.generate_all([request])
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()

    async def generate_all(self, requests: Sequence[GenerateRequest]) -> list[RequestStream]:
        """Several prompts as one unit: each is checked and tokenized, then all are queued at
        once or none is (InvalidRequest / Overloaded / EngineUnavailable). Closing a stream
        aborts its request; `complete_all` closes the siblings of one that fails."""
        self.inputs.check(requests)
        if not self.health():
            raise EngineUnavailable("the engine is not accepting requests")
        self._preparing += len(requests)
        try:
            # off the event loop: a long prompt must not stall the other streams
            prepared = await asyncio.to_thread(lambda: [self.inputs.prepare(r) for r in requests])
            # on the grammar compiler's own pool, bounded (engine/grammar.py): never the pool
            # that tokenizes, never longer than its timeout
            compiled = await asyncio.gather(
                *(
                    self.inputs.grammars().compile_async(r.params.grammar)
                    for r in requests
                    if r.params.grammar is not None
                )
            )
            grammars = iter(compiled)
            # the last wait: from here to the requests in _live, nothing else runs on this
            # event loop, so no eviction can pick the adapters they are given
            if self._adapters is not None:
                lora = {r.lora for r in requests if r.lora is not None}
                await self._adapters.make_resident(lora, self._in_use)
            if not self.health():  # drained or stopped while tokenizing
                raise EngineUnavailable("the engine is not accepting requests")
            loop = asyncio.get_running_loop()
            made = [
                self._request(r, ids, loop, next(grammars) if r.params.grammar else None, echo)
                for r, (ids, echo) in zip(requests, prepared, strict=True)
            ]
            self._loop.add_all([queued for queued, _ in made])  # raises Overloaded
        finally:
            self._preparing -= len(requests)
        streams = []
        for request, queue in made:
            key = next(self._keys)
            self._live[key] = request
            streams.append(RequestStream(self, key, request, queue))
        return streams

    def _request(
        self,
        request: GenerateRequest,
        prompt_ids: list[int],
        loop: asyncio.AbstractEventLoop,
        compiled: Any = None,
        echo: str | None = None,
    ) -> tuple[Request, asyncio.Queue[TokenEvent]]:
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(event: TokenEvent) -> None:  # runs on the step loop thread
            self._outbox.append((loop, queue, event))

        timeout = request.timeout if request.timeout is not None else self._default_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        return self.inputs.request(request, prompt_ids, sink, deadline, compiled, echo), queue

    def _release(self, key: int, request: Request) -> None:
        self._live.pop(key, None)
        if request.finish_reason is None:  # the consumer left early: free the row
            request.aborted = True
            self._loop.notify()

    def _after_step(self, stats: StepStats) -> None:
        """On the step loop thread, after each step: its stats to metrics, its events to their
        event loops at once."""
        try:
            if self._on_step is not None:
                self._on_step(stats)
            if self._adapters is not None and self._adapters.retiring():  # once unused
                self._adapters.free_unused(self._loop.adapters_in_use)
        finally:  # the events go out even when a metrics backend fails
            self._flush()

    # -- LoRA adapters at run time ------------------------------------------------------------
    def lora_requests(self) -> tuple[int, list[str], list[str]]:
        """How many adapters may run at once, and those of the running and of the waiting
        requests (what vLLM's `lora_requests_info` gauge reports)."""
        if self._adapters is None:
            return 0, [], []
        status = self._loop.status()
        return self._adapters.requests(status.running_adapters, status.waiting_adapters)

    async def load_adapter(self, name: str, path: str) -> None:
        """Read, check and register an adapter, resident where there is room (InvalidRequest
        with the reason)."""
        if self._adapters is None:
            raise InvalidRequest("this server serves no LoRA adapters")
        await self._adapters.load_now(name, path)

    async def unload_adapter(self, name: str) -> None:
        """New requests naming it get a 404 at once; its weights go when no request uses
        them."""
        if self._adapters is None:
            raise ModelMissing(f"LoRA adapter '{name}' is not loaded")
        self._adapters.unload(name)

    def _in_use(self) -> set[int]:
        """The adapter slots of the requests in flight, and of the rows and the queue as the
        step thread last published them (a row it admitted since came from the queue: its
        request is in flight, or was aborted and needs its adapter no more)."""
        status = self._loop.status()
        in_use = {r.adapter for r in self._live.values()}
        return in_use.union(status.running_adapters, status.waiting_adapters)

    def _flush(self) -> None:
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, TokenEvent]]] = {}
        for loop, queue, event in items:
            by_loop.setdefault(loop, []).append((queue, event))
        for loop, batch in by_loop.items():
            # a closed event loop raises RuntimeError: nobody is listening any more
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver, batch)

    async def abort(self, request_id: str) -> None:
        for request in list(self._live.values()):
            if request.request_id == request_id:
                request.aborted = True
        self._loop.notify()


class RequestStream:
    """One admitted request's events. Unlike an async generator, closing it aborts the request
    even if nobody ever iterated it, and so does cancelling a task waiting on it."""

    def __init__(
        self, engine: AsyncEngine, key: int, request: Request, queue: asyncio.Queue[TokenEvent]
    ) -> None:
        self._engine = engine
        self._key = key
        self._request = request
        self._queue = queue
        self._done = False

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            event = await self._queue.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            await self.aclose()
            raise
        if event.final:
            await self.aclose()
        return event

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._engine._release(self._key, self._request)


def _deliver(batch: list[tuple[asyncio.Queue[TokenEvent], TokenEvent]]) -> None:
    for queue, event in batch:
        queue.put_nowait(event)
