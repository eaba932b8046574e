"""Our types -> the Responses API's response object and its stream of events.

One `ResponseEncoder` per request reads the answer's text as it comes (with tools, through the
engine's call parser of the model's format, `engine/tool_formats/`) and turns it into output
items: a message item for text, a function_call item per call, in the order the text has them.
A stream sends each step as the Responses events (`response.output_item.added`,
`response.output_text.delta`, ..., `response.completed`); a unary answer feeds the whole text
to the same encoder and sends only the final response object, so the two always agree.

Every body is validated by the `openai` package's own pydantic types, so its shape follows the
SDK's (`openai.types.responses`). A response cut by `max_output_tokens` or the deadline has
status `incomplete` and `incomplete_details.reason` `max_output_tokens`; its stream still ends
with `response.completed` (as vLLM's does), which the SDK's stream helper needs for its final
response.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)
from pydantic import BaseModel

from predictor.engine import tool_formats
from predictor.protocols.openai.responses_api import ResponsesRequest
from predictor.types import FinishReason, Usage

Status = Literal["in_progress", "completed", "incomplete"]
Event = tuple[str, str]  # (event type, JSON text)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _dump(body: BaseModel) -> str:
    return body.model_dump_json(exclude_unset=True, by_alias=True)


@dataclass
class _Item:
    """One output item as it grows: a message's text or a call's arguments."""

    kind: Literal["message", "function_call", "reasoning"]
    id: str
    text: str = ""  # a message's text, a call's arguments, a thinking model's reasoning
    name: str = ""
    call_id: str = ""
    status: Status = "in_progress"

    def body(self) -> dict[str, Any]:
        if self.kind == "function_call":
            return {
                "type": "function_call",
                "id": self.id,
                "call_id": self.call_id,
                "name": self.name,
                "arguments": self.text,
                "status": self.status,
            }
        if self.kind == "reasoning":  # the text as reasoning_text content; no summary
            thought = [] if self.status == "in_progress" else [_thought(self.text)]
            return {
                "type": "reasoning",
                "id": self.id,
                "summary": [],
                "content": thought,
                "status": self.status,
            }
        content = [] if self.status == "in_progress" else [_part(self.text)]
        return {
            "type": "message",
            "id": self.id,
            "role": "assistant",
            "status": self.status,
            "content": content,
        }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _thought(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


@dataclass
class ResponseEncoder:
    """One request's answer, as output items and the events that build them."""

    request: ResponsesRequest
    items: list[_Item] = field(default_factory=list)
    _sequence: int = 0
    _open: _Item | None = None
    _parser: tool_formats.Parser | None = None

    def __post_init__(self) -> None:
        if self.request.reads_calls:
            self._parser = tool_formats.get(self.request.request.tool_format).parser()

    # -- events ---------------------------------------------------------------------------------

    @property
    def sequence(self) -> int:
        """The next event's sequence number."""
        return self._sequence

    def _event(self, model: type[BaseModel], kind: str, **fields: Any) -> Event:
        body = model.model_validate({"type": kind, "sequence_number": self._sequence, **fields})
        self._sequence += 1
        return kind, _dump(body)

    def opening(self) -> list[Event]:
        """`response.created` and `response.in_progress`, with no output yet."""
        snapshot = self.response("in_progress", None).model_dump(exclude_unset=True, by_alias=True)
        return [
            self._event(ResponseCreatedEvent, "response.created", response=snapshot),
            self._event(ResponseInProgressEvent, "response.in_progress", response=snapshot),
        ]

    def reasoning(self, text: str) -> list[Event]:
        """The events for the next piece of a thinking model's reasoning: a reasoning item
        (before the answer's items), its `response.reasoning_text.delta` events."""
        if not text:
            return []
        item, events = self._opened("reasoning", "rs", _thought(""))
        item.text += text
        events.append(
            self._event(
                ResponseReasoningTextDeltaEvent,
                "response.reasoning_text.delta",
                item_id=item.id,
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
            )
        )
        return events

    def text(self, text: str, final: bool) -> list[Event]:
        """The events for the next piece of the answer's text (`final`: it is the last)."""
        if self._parser is None:
            return self._content(text) if text else []
        events: list[Event] = []
        deltas = self._parser.feed(text) + (self._parser.finish() if final else [])
        for delta in deltas:
            if delta.kind == "content":
                events += self._content(delta.text)
            elif delta.kind == "call":
                events += self._start_call(delta.text)
            else:
                events += self._arguments(delta.text)
        return events

    def closing(self, reason: FinishReason, usage: Usage | None) -> list[Event]:
        """The open item's end and `response.completed` with the whole response."""
        events = self._finish(reason)
        response = self.response(self._status(reason), usage)
        completed = response.model_dump(exclude_unset=True, by_alias=True)
        kind = "response.completed"
        return [*events, self._event(ResponseCompletedEvent, kind, response=completed)]

    def whole(self, text: str, reason: FinishReason, usage: Usage, reasoning: str = "") -> str:
        """A unary answer: the response object for the whole text (and reasoning)."""
        self.reasoning(reasoning)
        self.text(text, final=True)
        self._finish(reason)
        return _dump(self.response(self._status(reason), usage))

    # -- items ----------------------------------------------------------------------------------

    def _opened(
        self, kind: Literal["message", "reasoning"], prefix: str, part: Any
    ) -> tuple[_Item, list[Event]]:
        """The open item if it is of `kind`; else the open one closed and a new one added with
        its first content part (`part`, empty): the item and the events that say so."""
        item = self._open
        if item is not None and item.kind == kind:
            return item, []
        events = self._close()
        item = self._add(_Item(kind, _id(prefix)))
        events.append(self._added_event(item))
        events.append(
            self._event(
                ResponseContentPartAddedEvent,
                "response.content_part.added",
                item_id=item.id,
                output_index=len(self.items) - 1,
                content_index=0,
                part=part,
            )
        )
        return item, events

    def _content(self, text: str) -> list[Event]:
        item, events = self._opened("message", "msg", _part(""))
        if not text:
            return events
        item.text += text
        events.append(
            self._event(
                ResponseTextDeltaEvent,
                "response.output_text.delta",
                item_id=item.id,
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _start_call(self, name: str) -> list[Event]:
        events = self._close()
        item = self._add(_Item("function_call", _id("fc"), name=name, call_id=_id("call")))
        return [*events, self._added_event(item)]

    def _arguments(self, text: str) -> list[Event]:
        item = self._open
        assert item is not None and item.kind == "function_call", "arguments outside a call"
        item.text += text
        return [
            self._event(
                ResponseFunctionCallArgumentsDeltaEvent,
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=len(self.items) - 1,
                delta=text,
            )
        ]

    def _add(self, item: _Item) -> _Item:
        self.items.append(item)
        self._open = item
        return item

    def _added_event(self, item: _Item) -> Event:
        return self._event(
            ResponseOutputItemAddedEvent,
            "response.output_item.added",
            output_index=self.items.index(item),
            item=item.body(),
        )

    def _close(self, status: Status = "completed") -> list[Event]:
        """The open item's done events."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        item.status = status
        events: list[Event] = []
        if item.kind == "reasoning":
            events += [
                self._event(
                    ResponseReasoningTextDoneEvent,
                    "response.reasoning_text.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    text=item.text,
                ),
                self._event(
                    ResponseContentPartDoneEvent,
                    "response.content_part.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=_thought(item.text),
                ),
            ]
        elif item.kind == "message":
            events += [
                self._event(
                    ResponseTextDoneEvent,
                    "response.output_text.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    text=item.text,
                    logprobs=[],
                ),
                self._event(
                    ResponseContentPartDoneEvent,
                    "response.content_part.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=_part(item.text),
                ),
            ]
        else:
            events.append(
                self._event(
                    ResponseFunctionCallArgumentsDoneEvent,
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    arguments=item.text,
                )
            )
        events.append(
            self._event(
                ResponseOutputItemDoneEvent,
                "response.output_item.done",
                output_index=index,
                item=item.body(),
            )
        )
        return events

    def _finish(self, reason: FinishReason) -> list[Event]:
        """The end of the answer: an empty message where nothing was written, the last item
        closed (incomplete where the answer was cut short)."""
        answered = any(i.kind != "reasoning" for i in self.items)
        events = [] if answered else self._content("")
        cut = self._status(reason) == "incomplete"
        return events + self._close("incomplete" if cut else "completed")

    # -- the response object --------------------------------------------------------------------

    @staticmethod
    def _status(reason: FinishReason) -> Status:
        cut = reason in (FinishReason.LENGTH, FinishReason.TIMEOUT)
        return "incomplete" if cut else "completed"

    def response(self, status: Status, usage: Usage | None) -> Response:
        """The response object: what was asked (echoed), the output so far, the usage."""
        request = self.request
        params = request.request.params
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        choice = request.tool_choice
        body: dict[str, Any] = {
            "id": request.id,
            "object": "response",
            "created_at": request.created,
            "model": request.model,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": dict(request.metadata or {}),
            "output": [i.body() for i in self.items] if status != "in_progress" else [],
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "temperature": params.temperature,
            "top_p": params.top_p,
            "text": {"format": request.text_format},
            "tool_choice": choice if isinstance(choice, str) else dict(choice),
            "tools": [dict(t) for t in request.tools],
            "truncation": "disabled",
            "background": False,
            "usage": None if usage is None else _usage(usage),
            "user": request.user,
        }
        return Response.model_validate(body)


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.generated_tokens,
    }
