"""The asyncio front of the engine: one queue per request, admission, the thread bridge.

Events cross from the step loop thread to the event loop in one place only: the sink made in
`generate` collects each step's events, and `_flush` (run by the step loop after each step)
hands them over with one `loop.call_soon_threadsafe` per step, not one per row.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from predictor.engine.batch import Sequence as EngineSequence
from predictor.engine.detokenizer import IncrementalDetokenizer, byte_table
from predictor.engine.kv_cache import blocks_for
from predictor.engine.step_loop import StepLoop
from predictor.errors import EngineUnavailable, InvalidRequest
from predictor.types import GenerateRequest, TokenEvent


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


class AsyncEngine:
    """Implements `EngineClient` over a `StepLoop`."""

    def __init__(
        self,
        step_loop: StepLoop,
        tokenizer: Tokenizer,
        *,
        max_tokens_limit: int,
        max_prompt_tokens: int,
        default_timeout: float | None = None,
    ) -> None:
        self._loop = step_loop
        self._tokenizer = tokenizer
        self._byte_table = byte_table(tokenizer)
        self.max_tokens_limit = max_tokens_limit
        self.max_prompt_tokens = max_prompt_tokens
        self._default_timeout = default_timeout
        self._live: dict[int, EngineSequence] = {}
        # this step's events, appended and flushed on the step loop thread only
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[TokenEvent], TokenEvent]]
        self._outbox = []
        step_loop.after_step = self._flush
        self._keys = itertools.count()
        self._accepting = True

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop.start()

    def drain(self) -> None:
        """Refuse new requests (EngineUnavailable); the ones in flight go on."""
        self._accepting = False

    def stop(self) -> None:
        """Stop the step loop; requests still in flight end with an error."""
        self._accepting = False
        self._loop.stop()

    def health(self) -> bool:
        return self._accepting and self._loop.alive()

    def running(self) -> int:
        return len(self._loop.batch)

    def waiting(self) -> int:
        return self._loop.scheduler.waiting()

    # -- requests -----------------------------------------------------------------------------
    def encode_prompt(self, request: GenerateRequest) -> list[int]:
        if request.messages is not None or request.chat:
            conversation = (
                list(request.messages)
                if request.messages is not None
                else [{"role": "user", "content": request.prompt}]
            )
            text = self._tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False
            )
            ids = self._tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self._tokenizer.encode(request.prompt)
        if not ids:
            raise InvalidRequest("text_input must not be empty")
        if len(ids) > self.max_prompt_tokens:
            raise InvalidRequest(
                f"prompt is {len(ids)} tokens; the limit is {self.max_prompt_tokens} tokens"
            )
        return ids

    def _check(self, request: GenerateRequest) -> None:
        max_tokens = request.params.max_tokens
        if not 1 <= max_tokens <= self.max_tokens_limit:
            raise InvalidRequest(
                f"max_tokens must be between 1 and {self.max_tokens_limit}, got {max_tokens}"
            )
        if not self.health():
            raise EngineUnavailable("the engine is not accepting requests")

    def _check_fits(self, prompt_ids: list[int], max_tokens: int) -> None:
        cache = self._loop.allocator
        if blocks_for(len(prompt_ids) + max_tokens, cache.block_size) > cache.num_blocks:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceed the "
                f"KV cache ({cache.num_blocks * cache.block_size} tokens)"
            )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        self._check(request)
        prompt_ids = self.encode_prompt(request)
        self._check_fits(prompt_ids, request.params.max_tokens)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(event: TokenEvent) -> None:  # runs on the step loop thread
            self._outbox.append((loop, queue, event))

        timeout = request.timeout if request.timeout is not None else self._default_timeout
        seq = EngineSequence(
            request_id=request.request_id,
            prompt_ids=prompt_ids,
            params=request.params,
            detokenizer=IncrementalDetokenizer(
                self._tokenizer, prompt_ids, request.params.stop, self._byte_table
            ),
            sink=sink,
            deadline=None if timeout is None else time.monotonic() + timeout,
        )
        self._loop.scheduler.add(seq)  # raises Overloaded
        key = next(self._keys)
        self._live[key] = seq
        self._loop.notify()
        try:
            while True:
                event = await queue.get()
                yield event
                if event.final:
                    return
        finally:
            self._live.pop(key, None)
            if seq.finish_reason is None:  # the consumer left early: free the row
                seq.aborted = True
                self._loop.notify()

    def _flush(self) -> None:
        """On the step loop thread: hand this step's events to their event loops at once."""
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
        for seq in list(self._live.values()):
            if seq.request_id == request_id:
                seq.aborted = True
        self._loop.notify()


def _deliver(batch: list[tuple[asyncio.Queue[TokenEvent], TokenEvent]]) -> None:
    for queue, event in batch:
        queue.put_nowait(event)
