"""What every streaming transport does with a request's events, in one place.

- `first_event`: a stream's first event, or the error of a request that failed before it.
- `emitted`: the events worth sending (text, the end, or every token when token counts must add
  up), ending after the final one or an error.
- `one_prompt`: the request of a route that streams one prompt.
- `whole`: a request's events as one final event holding the whole text (a non-streamed answer
  on a streaming route).
- `sse`, `sse_event` / `sse_response`: Server-Sent Events framing (data only, or named: `event:
  NAME`, as Anthropic's streams), and a response that waits for the first event (an error
  before it is a JSON error with a status) and closes the streams when the client leaves or the
  stream ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response, StreamingResponse

from predictor.engine.client import Stream, complete, failure
from predictor.errors import GenerationFailed, InvalidRequest, PredictorError
from predictor.types import Completion, GenerateRequest, TokenEvent

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


async def first_event(events: Stream) -> TokenEvent:
    """The stream's first event; a request that failed before anything was sent raises its
    error (then the answer is a JSON error with its status, not a 200 and an error event)."""
    try:
        event = await events.__anext__()
    except StopAsyncIteration:
        raise GenerationFailed("the engine ended the request without an event") from None
    if event.error is not None and event.final and not event.text and not event.token_ids:
        raise failure(event)
    return event


def worth_sending(event: TokenEvent, every_token: bool = False) -> bool:
    """Text, the end, or (when each response must count its tokens) any new token."""
    return bool(event.text or event.final or (every_token and event.token_ids))


async def emitted(
    first: TokenEvent, events: Stream, every_token: bool = False
) -> AsyncIterator[TokenEvent]:
    """`first` and the events after it that are worth sending, through the final one or the
    first error (an event with `error` set, yielded as it is)."""
    event: TokenEvent | None = first
    while event is not None:
        if event.error is not None or worth_sending(event, every_token):
            yield event
        if event.final or event.error is not None:
            return
        event = await anext(events, None)


class WholeStream:
    """A request's events as one final event holding the whole text; `aclose` closes them."""

    def __init__(
        self, events: Stream, as_event: Callable[[Completion], TokenEvent] | None = None
    ) -> None:
        self._events = events
        self._as_event = as_event
        self._done = False

    def __aiter__(self) -> WholeStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        self._done = True
        c = await complete(self._events)
        if self._as_event is not None:
            return self._as_event(c)
        return TokenEvent(
            c.request_id, c.text, (), c.finish_reason, c.usage, logprobs=c.logprobs, prompt=c.prompt
        )

    async def aclose(self) -> None:
        self._done = True
        await self._events.aclose()


def whole(events: Stream, as_event: Callable[[Completion], TokenEvent] | None = None) -> Stream:
    return WholeStream(events, as_event)


def one_prompt(requests: list[GenerateRequest], route: str) -> GenerateRequest:
    """The request of a route that streams one prompt."""
    (request, *more) = requests
    if more:
        raise InvalidRequest(f"{route} takes one text_input element")
    return request


def sse(data: str | dict[str, Any]) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """An SSE event with its name (`event: NAME`), as Anthropic's streams send each."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def sse_response(
    start: Awaitable[T],
    body: Callable[[T], AsyncIterator[bytes]],
    render_error: Callable[[BaseException], Response],
    close: Callable[[], Awaitable[None]],
) -> Response:
    """Await `start` (the first event or events); an error there is `render_error`'s JSON
    answer. Then stream `body(started)` as text/event-stream; `close` runs when it ends or the
    client leaves (freeing the engine rows)."""
    try:
        started = await start
    except PredictorError as exc:
        await close()
        return render_error(exc)
    except BaseException:
        await close()
        raise

    async def stream() -> AsyncIterator[bytes]:
        try:
            async for chunk in body(started):
                yield chunk
        finally:
            await close()

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)
