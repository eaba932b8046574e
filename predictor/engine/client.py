"""The engine's face: the small Protocols the adapters depend on.

`EngineClient` is what every transport uses: generation, the lifecycle, health, sleep and the
prefix cache. `AdapterAdmin` is LoRA adapters' administration at run time (vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter, the adapters' gauge): only the server's
wiring and the base model use it, never a route that generates."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Protocol, TypeVar

from predictor.errors import GenerationFailed, InvalidRequest, PredictorError
from predictor.types import (
    Completion,
    FinishReason,
    GenerateRequest,
    PromptEcho,
    TokenEvent,
    TokenLogprob,
)

T = TypeVar("T")


class Stream(Protocol):
    """One request's events; `aclose` aborts the request if it has not ended."""

    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...
    def __anext__(self) -> Awaitable[TokenEvent]: ...
    def aclose(self) -> Awaitable[None]: ...


class EngineClient(Protocol):
    """Generation and the engine's state: what every served model and transport uses."""

    def start(self) -> None:
        """Start the step loop (called once the server's event loop runs)."""
        ...

    def drain(self) -> None:
        """Refuse new requests; those in flight go on."""
        ...

    def stop(self) -> None: ...

    def generate(self, request: GenerateRequest) -> Stream:
        """Stream one request's events; the last has finish_reason set.

        Raises InvalidRequest / Overloaded / EngineUnavailable before the first event.
        Closing the iterator early aborts the request.
        """
        ...

    async def generate_all(self, requests: Sequence[GenerateRequest]) -> Sequence[Stream]:
        """Several prompts as one unit: all queued or none (InvalidRequest / Overloaded /
        EngineUnavailable raised here). Closing a stream aborts its request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def tokenize(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids as a generation would see them (chat template and all)."""
        ...

    async def detokenize(self, ids: Sequence[int]) -> str:
        """Token ids -> text (InvalidRequest for an id outside the vocabulary)."""
        ...

    def health(self) -> bool:
        """True while the step loop is alive and accepting work."""
        ...

    def ready(self) -> bool:
        """Healthy, and the runner's kernels prepared (readiness)."""
        ...

    def live(self) -> bool:
        """False when the step thread died or rows run but no step completes (liveness)."""
        ...

    def running(self) -> int:
        """Requests holding a batch row now."""
        ...

    def waiting(self) -> int:
        """Requests waiting for a batch row now."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while a row holds blocks."""
        ...

    async def sleep(self) -> None:
        """Free the model's weights and KV cache; the next request loads them again
        (InvalidRequest where the engine cannot sleep)."""
        ...

    async def wake_up(self) -> None:
        """Load the model again now if it sleeps (EngineUnavailable where it cannot)."""
        ...

    def is_sleeping(self) -> bool:
        """Whether the model's weights and KV cache are freed now."""
        ...


class AdapterAdmin(Protocol):
    """LoRA adapters loaded, unloaded and listed at run time."""

    async def load_adapter(self, name: str, path: str) -> None:
        """Read, check and make resident a LoRA adapter (InvalidRequest with the reason)."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Requests naming it get ModelMissing from now on."""
        ...

    def lora_requests(self) -> tuple[int, list[str], list[str]]:
        """Adapters that may run at once; those of the running and of the waiting requests."""
        ...


def failure(event: TokenEvent) -> PredictorError:
    """The error a failed request's final event stands for: the client's (InvalidRequest, its
    parameter named) or the engine's (GenerationFailed)."""
    if event.error_param is not None:
        return InvalidRequest(event.error or "the request cannot be honoured", event.error_param)
    return GenerationFailed(event.error or "generation failed")


async def complete(events: Stream) -> Completion:
    """Run one request's events to the end and collect its text (the unary endpoints' path)."""
    parts: list[str] = []
    thoughts: list[str] = []
    logprobs: list[TokenLogprob] = []
    prompt: PromptEcho | None = None
    try:
        async for event in events:
            prompt = prompt or event.prompt
            parts.append(event.text)
            thoughts.append(event.reasoning)
            logprobs.extend(event.logprobs)
            if event.final:
                assert event.finish_reason is not None and event.usage is not None
                if event.finish_reason is FinishReason.ERROR:
                    raise failure(event)
                text = "".join(parts)
                return Completion(
                    event.request_id,
                    text,
                    event.finish_reason,
                    event.usage,
                    tuple(logprobs),
                    prompt,
                    event.stop_sequence,
                    "".join(thoughts),
                )
    finally:
        await events.aclose()
    raise GenerationFailed("the engine ended the request without a final event")


async def complete_all(streams: Sequence[Stream]) -> list[Completion]:
    """Run several requests (one unit) to the end; the first failure closes the others at once
    (their rows are freed) and is raised."""
    if len(streams) == 1:
        return [await complete(streams[0])]
    try:
        return await gather_all([complete(s) for s in streams])
    finally:
        for stream in streams:  # a task cancelled before it started never closed its stream
            await stream.aclose()


async def gather_all(work: Sequence[Awaitable[T]]) -> list[T]:
    """Every result, or the first error once the rest are cancelled (and have ended)."""
    if len(work) == 1:
        return [await work[0]]
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class AdapterClient:
    """The engine as one LoRA adapter serves it (a model of its own name on every protocol):
    each request runs with that adapter; the engine's lifecycle belongs to the base model's
    client, so starting and stopping here do nothing."""

    def __init__(self, engine: EngineClient, adapter: str | None) -> None:
        self.engine = engine
        self.adapter = adapter  # None: the model itself under another name

    def _adapted(self, request: GenerateRequest) -> GenerateRequest:
        if self.adapter is None:
            return request
        return dataclasses.replace(request, lora=self.adapter)

    def start(self) -> None:
        pass

    def drain(self) -> None:
        self.engine.drain()

    def stop(self) -> None:
        pass

    def generate(self, request: GenerateRequest) -> Stream:
        return self.engine.generate(self._adapted(request))

    async def generate_all(self, requests: Sequence[GenerateRequest]) -> Sequence[Stream]:
        return await self.engine.generate_all([self._adapted(r) for r in requests])

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def tokenize(self, request: GenerateRequest) -> list[int]:
        return await self.engine.tokenize(request)

    async def detokenize(self, ids: Sequence[int]) -> str:
        return await self.engine.detokenize(ids)

    def health(self) -> bool:
        return self.engine.health()

    def ready(self) -> bool:
        return self.engine.ready()

    def live(self) -> bool:
        return self.engine.live()

    def running(self) -> int:
        return self.engine.running()

    def waiting(self) -> int:
        return self.engine.waiting()

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    async def sleep(self) -> None:
        await self.engine.sleep()

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()
