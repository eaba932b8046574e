"""The asyncio front of the engine: one queue per request, admission, the thread bridge.

Events cross from the step loop thread to the event loop in one place only: the sink made in
`_sequence` collects each step's events, and `_flush` (run by the step loop after each step)
hands them over with one `loop.call_soon_threadsafe` per step, not one per row.

Tokenization, chat templating and grammar compiling (engine/grammar.py, made on first use, so a
server that never sees a grammar never loads it) run in a worker thread, never on the event
loop nor on the step loop. A request
with several prompts is one unit (`generate_all`): admitted whole or refused whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from typing import Any, Protocol

from predictor.engine import tool_calls
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
        max_prompts: int = 16,
        stall_seconds: float = 120.0,
        grammar_timeout: float = 10.0,
        max_grammar_compiles: int = 16,
    ) -> None:
        self._loop = step_loop
        self._grammar_limits = (grammar_timeout, max_grammar_compiles)
        self._tokenizer = tokenizer
        self._byte_table = byte_table(tokenizer)
        self.max_tokens_limit = max_tokens_limit
        self.max_prompt_tokens = max_prompt_tokens
        self.max_prompts = max_prompts
        self.stall_seconds = stall_seconds
        self._default_timeout = default_timeout
        # a token never spells more characters than its vocabulary entry has symbols, so a text
        # longer than this is too long without tokenizing it
        longest = max((len(t) for t in _vocabulary(tokenizer)), default=0)
        self._max_prompt_chars = max_prompt_tokens * longest if longest else None
        self._live: dict[int, EngineSequence] = {}
        self._preparing = 0  # requests being tokenized: in flight, not yet in the scheduler
        # this step's events, appended and flushed on the step loop thread only
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[TokenEvent], TokenEvent]]
        self._outbox = []
        step_loop.after_step = self._flush
        self._keys = itertools.count()
        self._grammars: Any = None  # engine.grammar.Grammars, made by the first grammar
        self._grammars_lock = threading.Lock()
        self._accepting = True
        self._started = False
        self._stopped = False

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._started = True
        self._loop.start()

    def drain(self) -> None:
        """Refuse new requests (EngineUnavailable); the ones in flight go on."""
        self._accepting = False

    def stop(self) -> None:
        """Stop the step loop; requests still in flight end with an error."""
        self._accepting = False
        self._stopped = True
        self._loop.stop()
        if self._grammars is not None:
            self._grammars.close()

    def live(self) -> bool:
        """False when the step thread died without being stopped, or rows are running and no
        step has completed for `stall_seconds` (a hung kernel): the process should restart."""
        if self._stopped:
            return True  # stopped on purpose (drain, unload): readiness says so, not liveness
        if self._started and not self._loop.alive():
            return False
        stalled = time.monotonic() - self._loop.last_progress > self.stall_seconds
        return not (len(self._loop.batch) and stalled)

    def health(self) -> bool:
        """Accepting requests, the step thread alive and making progress."""
        return self._accepting and self._loop.alive() and self.live()

    def ready(self) -> bool:
        """Healthy, and the runner prepared on the step thread (its kernels compiled and tuned):
        requests sent before then are queued, and wait for it."""
        return self._loop.prepared.is_set() and self.health()

    def running(self) -> int:
        return len(self._loop.batch)

    def waiting(self) -> int:
        """Requests waiting for a batch row, counting those still being tokenized."""
        return self._loop.scheduler.waiting() + self._preparing

    # -- requests -----------------------------------------------------------------------------
    def encode_prompt(self, request: GenerateRequest) -> list[int]:
        """Template and tokenize (blocking: called in a worker thread by `generate_all`)."""
        if request.prompt_ids is not None:
            self._check_ids(request.prompt_ids, "prompt")
            ids = list(request.prompt_ids)
        elif request.messages is not None or request.chat:
            conversation = (
                list(request.messages)
                if request.messages is not None
                else [{"role": "user", "content": request.prompt}]
            )
            # a template only adds text: an overlong conversation is refused before rendering
            # (jinja held the GIL for 8 ms at a time rendering a 4 MiB message)
            self._check_length(sum(map(len, _texts(conversation))))
            text = self._render(conversation, request.tools)
            self._check_length(len(text))
            ids = self._tokenizer.encode(text, add_special_tokens=False)
        else:
            self._check_length(len(request.prompt))
            ids = self._tokenizer.encode(request.prompt)
        if not ids:
            raise InvalidRequest("text_input must not be empty")
        if len(ids) > self.max_prompt_tokens:
            raise InvalidRequest(
                f"prompt is {len(ids)} tokens; the limit is {self.max_prompt_tokens} tokens"
            )
        return ids

    def _render(
        self, conversation: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
    ) -> str:
        """The chat template's text; tools and tool turns as `engine/tool_calls.py` writes them
        for a template that does not render them itself."""
        if tool_calls.native(getattr(self._tokenizer, "chat_template", None)):
            extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
            return str(
                self._tokenizer.apply_chat_template(
                    conversation, add_generation_prompt=True, tokenize=False, **extra
                )
            )
        if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in conversation):
            conversation = tool_calls.plain_conversation(conversation, tools)
        return str(
            self._tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False
            )
        )

    def _vocab_size(self) -> int | None:
        size: Any = getattr(self._tokenizer, "__len__", None)
        return size() if size is not None else None

    def _check_ids(self, ids: Sequence[int], param: str) -> None:
        vocab = self._vocab_size()
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise InvalidRequest(
                f"'{param}' holds a token id outside the vocabulary (0 to {vocab - 1})",
                param=param,
            )

    async def tokenize(self, request: GenerateRequest) -> list[int]:
        return await asyncio.to_thread(self.encode_prompt, request)

    async def detokenize(self, ids: Sequence[int]) -> str:
        self._check_ids(ids, "tokens")
        return await asyncio.to_thread(self._tokenizer.decode, list(ids))

    def _check_length(self, chars: int) -> None:
        if self._max_prompt_chars is not None and chars > self._max_prompt_chars:
            raise InvalidRequest(
                f"prompt is {chars} characters: more than the limit of "
                f"{self.max_prompt_tokens} tokens"
            )

    def grammars(self) -> Any:
        """The grammar compiler (blocking the first time: it reads the vocabulary)."""
        with self._grammars_lock:
            if self._grammars is None:
                from predictor.engine.grammar import Grammars  # xgrammar loads only when used

                timeout, in_flight = self._grammar_limits
                self._grammars = Grammars(self._tokenizer, self._loop.eos_ids, timeout=timeout,
                                          max_in_flight=in_flight)  # fmt: skip
            return self._grammars

    def prepare(self, request: GenerateRequest) -> tuple[list[int], str | None]:
        """The prompt's tokens and its text when the request echoes it (blocking: a worker
        thread); the grammar compiler made if the request has a grammar (its first time reads
        the vocabulary)."""
        ids = self.encode_prompt(request)
        echo = None
        if request.echo:  # the text as given; token ids (or a rendered chat) decoded
            plain = request.prompt_ids is None and request.messages is None and not request.chat
            echo = request.prompt if plain else self._tokenizer.decode(ids)
        vocab = self._vocab_size()
        if vocab is not None and any(t >= vocab for t, _ in request.params.logit_bias):
            raise InvalidRequest(
                f"logit_bias names a token id outside the vocabulary ({vocab} tokens)",
                param="logit_bias",
            )
        if request.params.grammar is not None:
            self.grammars()
        return ids, echo

    def _check(self, request: GenerateRequest) -> None:
        max_tokens = request.params.max_tokens
        if not 0 <= max_tokens <= self.max_tokens_limit:  # 0: only the prompt (echo)
            raise InvalidRequest(
                f"max_tokens must be between 0 and {self.max_tokens_limit}, got {max_tokens}"
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
        if not requests:
            raise InvalidRequest("a request needs at least one prompt")
        if len(requests) > self.max_prompts:
            raise InvalidRequest(
                f"{len(requests)} prompts in one request; the limit is {self.max_prompts}"
            )
        for request in requests:
            self._check(request)
        self._preparing += len(requests)
        try:
            # off the event loop: a long prompt must not stall the other streams
            prepared = await asyncio.to_thread(lambda: [self.prepare(r) for r in requests])
            for request, (prompt_ids, _) in zip(requests, prepared, strict=True):
                self._check_fits(prompt_ids, request.params.max_tokens)
            # on the grammar compiler's own pool, bounded (engine/grammar.py): never the pool
            # that tokenizes, never longer than its timeout
            compiled = await asyncio.gather(*(
                self.grammars().compile_async(r.params.grammar)
                for r in requests if r.params.grammar is not None
            ))  # fmt: skip
            grammars = iter(compiled)
            if not self.health():  # drained or stopped while tokenizing
                raise EngineUnavailable("the engine is not accepting requests")
            loop = asyncio.get_running_loop()
            made = [
                self._sequence(r, ids, loop, next(grammars) if r.params.grammar else None, echo)
                for r, (ids, echo) in zip(requests, prepared, strict=True)
            ]
            self._loop.scheduler.add_all([seq for seq, _ in made])  # raises Overloaded
        finally:
            self._preparing -= len(requests)
        streams = []
        for seq, queue in made:
            key = next(self._keys)
            self._live[key] = seq
            streams.append(RequestStream(self, key, seq, queue))
        self._loop.notify()
        return streams

    def _sequence(
        self,
        request: GenerateRequest,
        prompt_ids: list[int],
        loop: asyncio.AbstractEventLoop,
        compiled: Any = None,
        echo: str | None = None,
    ) -> tuple[EngineSequence, asyncio.Queue[TokenEvent]]:
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
            cache_salt=request.cache_salt,
            matcher=None if compiled is None else self.grammars().matcher(compiled),
            prompt_text=echo,
        )
        return seq, queue

    def _release(self, key: int, seq: EngineSequence) -> None:
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


class RequestStream:
    """One admitted request's events. Unlike an async generator, closing it aborts the request
    even if nobody ever iterated it, and so does cancelling a task waiting on it."""

    def __init__(
        self, engine: AsyncEngine, key: int, seq: EngineSequence, queue: asyncio.Queue[TokenEvent]
    ) -> None:
        self._engine = engine
        self._key = key
        self._seq = seq
        self._queue = queue
        self._done = False

    @property
    def request_id(self) -> str:
        return self._seq.request_id

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
            self._engine._release(self._key, self._seq)


def _vocabulary(tokenizer: Any) -> list[str]:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    try:
        return list(get_vocab()) if get_vocab is not None else []
    except Exception:  # a tokenizer without a vocabulary listing: no early length check
        return []


def _deliver(batch: list[tuple[asyncio.Queue[TokenEvent], TokenEvent]]) -> None:
    for queue, event in batch:
        queue.put_nowait(event)


def _texts(conversation: Sequence[Mapping[str, Any]]) -> Iterator[str]:
    """The text contents of a conversation's messages."""
    for message in conversation:
        content = message.get("content")
        if isinstance(content, str):
            yield content
