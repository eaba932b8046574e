"""The engine's face: the small Protocol every adapter depends on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from predictor.errors import GenerationFailed
from predictor.types import (
    Completion,
    FinishReason,
    GenerateRequest,
    TokenEvent,
    TokenLogprob,
)


class EngineClient(Protocol):
    def start(self) -> None:
        """Start the step loop (called once the server's event loop runs)."""
        ...

    def drain(self) -> None:
        """Refuse new requests; those in flight go on."""
        ...

    def stop(self) -> None: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream one request's events; the last has finish_reason set.

        Raises InvalidRequest / Overloaded / EngineUnavailable before the first event.
        Closing the iterator early aborts the request.
        """
        ...

    async def abort(self, request_id: str) -> None: ...

    def health(self) -> bool:
        """True while the step loop is alive and accepting work."""
        ...

    def running(self) -> int:
        """Requests holding a batch row now."""
        ...

    def waiting(self) -> int:
        """Requests waiting for a batch row now."""
        ...


async def complete(events: AsyncIterator[TokenEvent]) -> Completion:
    """Run one request's events to the end and collect its text (the unary endpoints' path)."""
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    try:
        async for event in events:
            parts.append(event.text)
            logprobs.extend(event.logprobs)
            if event.final:
                assert event.finish_reason is not None and event.usage is not None
                if event.finish_reason is FinishReason.ERROR:
                    raise GenerationFailed(event.error or "generation failed")
                text = "".join(parts)
                return Completion(
                    event.request_id, text, event.finish_reason, event.usage, tuple(logprobs)
                )
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    raise GenerationFailed("the engine ended the request without a final event")
