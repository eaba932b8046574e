"""Our types -> OpenAI completions, chat completions, stream chunks, models lists and errors.

Every body is built with the `openai` package's own pydantic types, so its shape follows the
SDK's. Fields we set are sent, even when null (as OpenAI sends `finish_reason: null` in a
chunk); fields we leave alone are left out.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

from openai.types import Completion as CompletionBody
from openai.types import CompletionChoice, CompletionUsage, Model
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCall,
)
from openai.types.chat import chat_completion as chat
from openai.types.chat import chat_completion_chunk as chunk
from openai.types.chat.chat_completion_message_function_tool_call import Function
from openai.types.completion_usage import CompletionTokensDetails, PromptTokensDetails
from openai.types.shared import ErrorObject
from pydantic import BaseModel

from predictor.engine import tool_formats
from predictor.engine.tool_formats.base import split_with
from predictor.protocols.openai.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from predictor.protocols.openai.requests import OpenAIRequest
from predictor.types import (
    Completion,
    FinishReason,
    TokenEvent,
    TokenLogprob,
    Usage,
)

OWNER = "gptq-predictor"

FinishName = Literal["stop", "length"]
Part = TypeVar("Part", bound=BaseModel)


def finish_name(reason: FinishReason) -> FinishName:
    """End of sequence and stop strings are `stop`; a token cap or a deadline is `length`."""
    return "length" if reason in (FinishReason.LENGTH, FinishReason.TIMEOUT) else "stop"


def chat_finish(reason: FinishReason, called: bool) -> FinishName | Literal["tool_calls"]:
    """As `finish_name`, but `tool_calls` where a text that ended on its own made calls."""
    name = finish_name(reason)
    return "tool_calls" if called and name == "stop" else name


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _message(request: OpenAIRequest, text: str) -> tuple[ChatCompletionMessage, bool]:
    """The assistant's message; with tools, the calls read out of its text."""
    if not request.tools:
        return ChatCompletionMessage(role="assistant", content=text), False
    content, calls = split_with(tool_formats.get(request.choices[0].tool_format).parser(), text)
    message = ChatCompletionMessage(role="assistant", content=content)
    if calls:
        message.tool_calls = [
            ChatCompletionMessageFunctionToolCall(
                id=call_id(),
                type="function",
                function=Function(name=c.name, arguments=c.arguments),
            )
            for c in calls
        ]
    return message, bool(calls)


def with_reasoning(part: Part, reasoning: str) -> Part:
    """A thinking model's reasoning beside its answer, under vLLM's two names (`reasoning`,
    and `reasoning_content` as before); a model that did not think gets neither."""
    if reasoning:
        part.reasoning_content = reasoning  # type: ignore[attr-defined]  # the SDK allows extras
        part.reasoning = reasoning  # type: ignore[attr-defined]
    return part


def dump(body: BaseModel) -> str:
    return body.model_dump_json(exclude_unset=True)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`."""
    error = ErrorObject(message=message, type=kind, param=param, code=code)
    return {"error": error.model_dump(include={"message", "type", "param", "code"})}


def models_list(
    names: Sequence[str],
    served: Sequence[str],
    created: int,
    lineage: Mapping[str, tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """OpenAI's model list (`object`, `data`) and, in the same body, KServe V1's `models`.
    `lineage`: a LoRA adapter's (parent, root) by name: vLLM lists the base model it adapts
    and the path it was loaded from."""
    data = []
    for name in served:
        entry = Model(id=name, created=created, object="model", owned_by=OWNER)
        listed = entry.model_dump(exclude_unset=True)
        if lineage and name in lineage:
            listed["parent"], listed["root"] = lineage[name]
        data.append(listed)
    return {"object": "list", "data": data, "models": list(names)}


def _usage(request: OpenAIRequest, usages: Sequence[Usage]) -> CompletionUsage:
    """Each prompt counted once, every choice's tokens counted."""
    prompt = sum(u.prompt_tokens for i, u in enumerate(usages) if i % request.n == 0)
    completion = sum(u.generated_tokens for u in usages)
    cached = sum(u.cached_tokens for i, u in enumerate(usages) if i % request.n == 0)
    # speculative decoding's drafts, as OpenAI counts predicted outputs' tokens
    accepted = sum(u.accepted_draft_tokens for u in usages)
    rejected = sum(u.draft_tokens for u in usages) - accepted
    details = None
    if accepted or rejected:
        details = CompletionTokensDetails(
            accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected
        )
    return CompletionUsage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        completion_tokens_details=details,
    )


def _choice_extras(request: OpenAIRequest, c: Completion) -> dict[str, Any]:
    """Fields beyond OpenAI's on a choice (vLLM's prompt_logprobs), when asked for."""
    if request.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": prompt_logprobs(request, c.prompt)}


# -- unary ------------------------------------------------------------------------------------


def completion_response(request: OpenAIRequest, results: Sequence[Completion]) -> str:
    choices = [
        CompletionChoice(
            index=i,
            text=(c.prompt.text if request.echo and c.prompt else "") + c.text,
            finish_reason=finish_name(c.finish_reason),
            logprobs=(
                completion_logprobs(request, c.logprobs, 0, c.prompt if request.echo else None)
                if request.logprobs
                else None
            ),
            **_choice_extras(request, c),
        )
        for i, c in enumerate(results)
    ]
    body = CompletionBody(
        id=request.id,
        object="text_completion",
        created=request.created,
        model=request.model,
        choices=choices,
        usage=_usage(request, [c.usage for c in results]),
    )
    return dump(body)


def chat_response(request: OpenAIRequest, results: Sequence[Completion]) -> str:
    choices = []
    for i, c in enumerate(results):
        message, called = _message(request, c.text)
        with_reasoning(message, c.reasoning)
        logprobs = (
            chat.ChoiceLogprobs(content=chat_logprobs(request, c.logprobs), refusal=None)
            if request.logprobs
            else None
        )
        choices.append(
            chat.Choice(
                index=i,
                message=message,
                logprobs=logprobs,
                finish_reason=chat_finish(c.finish_reason, called),
            )
        )
    body = ChatCompletion(
        id=request.id,
        object="chat.completion",
        created=request.created,
        model=request.model,
        choices=choices,
        usage=_usage(request, [c.usage for c in results]),
        **_choice_extras(request, results[0]),  # vLLM: chat's prompt_logprobs is top-level
    )
    return dump(body)


# -- streams ----------------------------------------------------------------------------------


class ChunkEncoder:
    """One request's stream: its chunks as JSON text, event by event, choice by choice.

    Text held back by the detokenizer (a possible stop string) arrives later; the logprobs of
    its tokens wait for it and go out with the next chunk that carries text or the finish.
    """

    def __init__(self, request: OpenAIRequest) -> None:
        self.request = request
        count = len(request.choices)
        self._pending: list[list[TokenLogprob]] = [[] for _ in range(count)]
        self._offsets = [0] * count
        self._usages: list[Usage | None] = [None] * count
        # with tools: each choice's text read for calls, and each call's id
        fmt = tool_formats.get(request.choices[0].tool_format)
        self._parsers = [fmt.parser() for _ in range(count if request.tools else 0)]
        self._call_ids: list[list[str]] = [[] for _ in range(count)]

    def opening(self) -> list[str]:
        """Chat streams open with one chunk per choice that carries the assistant role."""
        if self.request.kind != "chat":
            return []
        role = chunk.ChoiceDelta(role="assistant", content="")
        return [
            self._chat_chunk(chunk.Choice(index=i, delta=role, finish_reason=None))
            for i in range(len(self.request.choices))
        ]

    def event(self, index: int, event: TokenEvent) -> str | None:
        """The chunk for one event of choice `index`, or None when it carries nothing yet."""
        self._pending[index].extend(event.logprobs)
        prompt = event.prompt if self.request.echo else None  # echo: the prompt goes first
        if not event.text and not event.final and prompt is None and not event.reasoning:
            return None
        tokens, self._pending[index] = self._pending[index], []
        finish = finish_name(event.finish_reason) if event.finish_reason is not None else None
        if event.usage is not None:
            self._usages[index] = event.usage
        if self.request.kind == "chat":
            delta = self._delta(index, event)
            if event.reasoning:  # a thinking model's reasoning, beside any answer text
                delta = with_reasoning(delta or chunk.ChoiceDelta(), event.reasoning)
            if delta is None:  # text held back by the call parser: its logprobs wait too
                self._pending[index][:0] = tokens
                return None
            chat_finish_name = (
                None
                if event.finish_reason is None
                else chat_finish(event.finish_reason, bool(self._call_ids[index]))
            )
            logprobs = (
                chunk.ChoiceLogprobs(content=chat_logprobs(self.request, tokens), refusal=None)
                if self.request.logprobs
                else None
            )
            return self._chat_chunk(
                chunk.Choice(
                    index=index, delta=delta, finish_reason=chat_finish_name, logprobs=logprobs
                )
            )
        logprobs_body = None
        if self.request.logprobs:
            logprobs_body = completion_logprobs(self.request, tokens, self._offsets[index], prompt)
            echoed = sum(len(t.token) for t in prompt.logprobs) if prompt is not None else 0
            self._offsets[index] += echoed + sum(len(t.token) for t in tokens)
        # OpenAI streams `finish_reason: null` until the end; the SDK's type allows only the
        # final values, so the choice is built unvalidated (every field still set by name).
        text = (prompt.text if prompt is not None else "") + event.text
        choice = CompletionChoice.model_construct(
            index=index, text=text, finish_reason=finish, logprobs=logprobs_body
        )
        return dump(self._completion_chunk([choice]))

    def _delta(self, index: int, event: TokenEvent) -> chunk.ChoiceDelta | None:
        """A chat chunk's delta: the text, or with tools the content and call pieces the parser
        has let through; None when there is nothing to send yet."""
        if not self.request.tools:
            return chunk.ChoiceDelta(content=event.text) if event.text else chunk.ChoiceDelta()
        parser = self._parsers[index]
        deltas = parser.feed(event.text) + (parser.finish() if event.final else [])
        content = "".join(d.text for d in deltas if d.kind == "content")
        calls: list[chunk.ChoiceDeltaToolCall] = []
        ids = self._call_ids[index]
        for d in deltas:
            if d.kind == "call":
                ids.append(call_id())
                calls.append(
                    chunk.ChoiceDeltaToolCall(
                        index=d.index,
                        id=ids[d.index],
                        type="function",
                        function=chunk.ChoiceDeltaToolCallFunction(name=d.text, arguments=""),
                    )
                )
            elif d.kind == "arguments":
                if calls and calls[-1].index == d.index and calls[-1].function is not None:
                    calls[-1].function.arguments = (calls[-1].function.arguments or "") + d.text
                else:
                    calls.append(
                        chunk.ChoiceDeltaToolCall(
                            index=d.index,
                            function=chunk.ChoiceDeltaToolCallFunction(arguments=d.text),
                        )
                    )
        if not content and not calls and not event.final:
            return None
        delta = chunk.ChoiceDelta()
        if content:
            delta.content = content
        if calls:
            delta.tool_calls = calls
        return delta

    def closing(self) -> list[str]:
        """The usage chunk (empty choices), when the request asked for it."""
        if not self.request.include_usage:
            return []
        usage = _usage(self.request, [u or Usage(0, 0) for u in self._usages])
        if self.request.kind == "chat":
            return [self._chat_chunk(None, usage)]
        return [dump(self._completion_chunk([], usage))]

    def _chat_chunk(self, choice: chunk.Choice | None, usage: CompletionUsage | None = None) -> str:
        body = ChatCompletionChunk(
            id=self.request.id,
            object="chat.completion.chunk",
            created=self.request.created,
            model=self.request.model,
            choices=[] if choice is None else [choice],
        )
        if self.request.include_usage:
            body.usage = usage  # null on every chunk but the last, as OpenAI sends it
        return dump(body)

    def _completion_chunk(
        self, choices: list[CompletionChoice], usage: CompletionUsage | None = None
    ) -> CompletionBody:
        body = CompletionBody.model_construct(
            id=self.request.id,
            object="text_completion",
            created=self.request.created,
            model=self.request.model,
            choices=choices,
        )
        if self.request.include_usage:
            body.usage = usage
        return body
