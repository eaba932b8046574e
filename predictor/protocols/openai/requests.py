"""OpenAI completions and chat completions request bodies -> our types.

The bodies' models (completions, chat, vLLM's tokenize and detokenize) and what a body means:
its prompts or turns, tools and sampling as engine requests, a choice each. A body is validated
by `validation.validate_body`: the sampling keys (max_tokens, temperature, stop, ...) by the one
parameter table (`protocols/parameters.py`, with OpenAI's defaults and ranges), the rest by these
strict pydantic models: a wrong type, a value out of range or a field we do not know is an
`InvalidRequest` naming it (`param`); fields OpenAI defines that we cannot honour (functions,
audio, ...) are refused by name unless they hold their harmless default. Tools: the calls'
format, grammar and parsing are the engine's (`engine/tool_formats/`: the model's format). The
response shapes are in `protocols/openai/responses.py`, the routes in `serving/rest/completions.py`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field, ValidationError

from predictor.errors import InvalidRequest
from predictor.protocols import parameters
from predictor.protocols.openai.messages import (
    MAX_TOOLS,
    AssistantToolCall,
    CalledFunction,
    FunctionDefinition,
    Message,
    NamedFunction,
    NamedToolChoice,
    TextPart,
    Tool,
    chat_prompt,
    conversation,
    tool_setup,
)
from predictor.protocols.openai.messages import Strict as _Strict
from predictor.protocols.openai.validation import param_of, telling_error, validate_body
from predictor.types import GenerateRequest, SamplingParams

MAX_CHOICES = 16  # n, and the number of prompts in one completions request
MAX_TOP_LOGPROBS = 20
SEED_MODULUS = parameters.SEED_LIMIT  # choice j of a seeded request uses (seed + j) mod 2**63


# -- body models --------------------------------------------------------------------------------


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Common(_Strict):
    """Fields completions and chat completions share beside the table's sampling keys
    (OpenAI's, then vLLM's extensions)."""

    model: str
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # the end user (or team) the request is for: the tenant label of the usage counters
    user: Annotated[str, Field(max_length=256)] | None = None
    return_tokens_as_token_ids: bool | None = None  # vLLM: logprob tokens as "token_id:{id}"


TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionBody(_Common):
    # a string, several strings, token ids, or several lists of token ids
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[
            list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)
        ]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_CHOICES)]
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    echo: bool | None = None  # the prompt before the completion (and in logprobs)


class ChatBody(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: variables for the chat template (enable_thinking: false turns Qwen3's off)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: a thinking model's thinking tokens at most, then its end tag is forced
    thinking_token_budget: int | None = Field(None, ge=0)
    # OpenAI's: "none" turns a thinking model's thinking off (enable_thinking false); the
    # others leave it as the model thinks (on a model that does not: see asks_thinking)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


_FIELD_NAMES = frozenset(
    name
    for model in (
        CompletionBody,
        ChatBody,
        Message,
        TextPart,
        StreamOptions,
        AssistantToolCall,
        CalledFunction,
        FunctionDefinition,
        Tool,
        NamedToolChoice,
        NamedFunction,
    )
    for name in model.model_fields
)


Body = TypeVar("Body", bound=_Common)
Model = TypeVar("Model", bound=_Strict)


def _validate(
    model: type[Body], body: Any, default_max_tokens: int, renames: Mapping[str, str] | None = None
) -> tuple[Body, parameters.Values]:
    """The body's own fields, and its sampling keys read by the parameter table. `renames`: keys
    that are another name of a table key on this route (chat's max_completion_tokens)."""
    return validate_body(model, body, default_max_tokens, _FIELD_NAMES, renames)


def requested_model(body: Any) -> str | None:
    """The `model` named in a body, if any (looked up before the rest is checked)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


# -- our view of a request ----------------------------------------------------------------------


@dataclass(frozen=True)
class OpenAIRequest:
    """One completions or chat request: its engine requests, prompt-major (choice index =
    position: prompt i, sample j is i * n + j), and how to answer."""

    kind: Literal["completion", "chat"]
    id: str
    model: str
    created: int
    n: int
    choices: tuple[GenerateRequest, ...]
    stream: bool
    include_usage: bool
    logprobs: bool  # whether choices carry logprobs (the engine's k is in each request's params)
    token_ids: bool = False  # logprob tokens written "token_id:{id}" (vLLM's option)
    tools: bool = False  # whether the choices' text is read for tool calls
    echo: bool = False  # completions: the prompt leads each choice's text and logprobs
    prompt_logprobs: int | None = None  # vLLM's: the k of the answer's prompt_logprobs
    # the field that asks the model to think (limits.check_thinking), None where none does
    asks_thinking: str | None = None


def _stream_flags(body: _Common) -> tuple[bool, bool]:
    stream = bool(body.stream)
    if body.stream_options is not None and not stream:
        raise InvalidRequest(
            "'stream_options' is only allowed with stream: true", param="stream_options"
        )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return stream, include_usage


def _choices(
    base: str,
    prompts: list[GenerateRequest],
    n: int,
    sampling: SamplingParams,
    salt: str | None = None,
    echo: bool = False,
    tenant: str | None = None,
) -> tuple[GenerateRequest, ...]:
    out = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            seed = None if sampling.seed is None else (sampling.seed + j) % SEED_MODULUS
            params = replace(sampling, seed=seed) if seed != sampling.seed else sampling
            rid = base if len(prompts) * n == 1 else f"{base}-{i * n + j}"
            out.append(
                replace(
                    prompt,
                    request_id=rid,
                    params=params,
                    cache_salt=salt,
                    echo=echo,
                    tenant=tenant,
                )
            )
    return tuple(out)


def decode_completion(body: Any, default_max_tokens: int) -> OpenAIRequest:
    parsed, values = _validate(CompletionBody, body, default_max_tokens)
    n = parsed.n or 1
    if parsed.best_of is not None and parsed.best_of != n:
        raise InvalidRequest(f"'best_of' must equal n ({n}) on this server", param="best_of")
    echo = bool(parsed.echo)
    stream, include_usage = _stream_flags(parsed)
    asked = _check_prompt_logprobs(values.sampling, stream, echo)
    scored = asked  # the engine scores the prompt for prompt_logprobs and for echo's logprobs
    if echo and parsed.logprobs is not None:
        scored = max(parsed.logprobs, asked or 0)
    sampling = replace(values.sampling, logprobs=parsed.logprobs, prompt_logprobs=scored)
    base = f"cmpl-{uuid.uuid4().hex}"
    prompts = _prompts(base, parsed.prompt)
    return OpenAIRequest(
        "completion",
        base,
        parsed.model,
        int(time.time()),
        n,
        _choices(base, prompts, n, sampling, values.cache_salt, echo, parsed.user),
        stream,
        include_usage,
        parsed.logprobs is not None,
        bool(parsed.return_tokens_as_token_ids),
        echo=echo,
        prompt_logprobs=asked,
    )


def _check_prompt_logprobs(sampling: SamplingParams, stream: bool, echo: bool) -> int | None:
    """max_tokens 0 only with echo (vLLM refuses it otherwise), prompt_logprobs not with
    stream (as vLLM); the prompt_logprobs asked for."""
    if sampling.max_tokens == 0 and not echo:
        raise InvalidRequest(
            "'max_tokens' must be at least 1 (0 only with echo: true, on completions)",
            param="max_tokens",
        )
    if stream and sampling.prompt_logprobs is not None:
        raise InvalidRequest(
            "'prompt_logprobs' is not available with stream: true", param="prompt_logprobs"
        )
    return sampling.prompt_logprobs


def _prompts(base: str, prompt: Any) -> list[GenerateRequest]:
    """A completions prompt (text, texts, token ids, lists of token ids) as engine requests."""
    if isinstance(prompt, str):
        return [GenerateRequest(base, prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [GenerateRequest(base, "", prompt_ids=tuple(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [GenerateRequest(base, text) for text in prompt]
    return [GenerateRequest(base, "", prompt_ids=tuple(ids)) for ids in prompt]


class TokenizeBody(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template. `model`
    may be left out where one model is served (vLLM's is optional too)."""

    model: str | None = None
    prompt: Annotated[str, Field(min_length=1)] | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # accepted; the engine tokenizes as it generates
    add_generation_prompt: bool | None = None  # accepted: the template always adds it
    return_token_strs: bool | None = None


class DetokenizeBody(_Strict):
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]


def _strict(model: type[Model], body: Any) -> Model:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return model.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        error = telling_error(exc, _FIELD_NAMES)
        param = param_of(error["loc"], _FIELD_NAMES | {"tokens", "prompt", str(error["loc"][-1])})
        raise InvalidRequest(f"'{param}': {error['msg']}", param=param or None) from exc


def decode_tokenize(body: Any) -> tuple[TokenizeBody, GenerateRequest]:
    parsed = _strict(TokenizeBody, body)
    if (parsed.prompt is None) == (parsed.messages is None):
        raise InvalidRequest("give one of 'prompt' or 'messages'", param="prompt")
    if parsed.messages is not None:
        messages = conversation(parsed.messages)
        return parsed, GenerateRequest("tokenize", "", chat=True, messages=messages)
    assert parsed.prompt is not None
    return parsed, GenerateRequest("tokenize", parsed.prompt)


def decode_detokenize(body: Any) -> DetokenizeBody:
    return _strict(DetokenizeBody, body)


def decode_chat(body: Any, default_max_tokens: int, tool_format: str = "hermes") -> OpenAIRequest:
    parsed, values = _validate(
        ChatBody, body, default_max_tokens, {"max_completion_tokens": "max_tokens"}
    )
    n = parsed.n or 1
    if parsed.top_logprobs is not None and not parsed.logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    k = (parsed.top_logprobs or 0) if parsed.logprobs else None
    tools, sampling = tool_setup(
        parsed.tools,
        parsed.tool_choice,
        parsed.parallel_tool_calls,
        replace(values.sampling, logprobs=k),
        tool_format,
    )
    stream, include_usage = _stream_flags(parsed)
    asked = _check_prompt_logprobs(sampling, stream, echo=False)
    base = f"chatcmpl-{uuid.uuid4().hex}"
    variables = parsed.chat_template_kwargs
    if parsed.reasoning_effort == "none":  # the request's own enable_thinking wins
        variables = {"enable_thinking": False} | (variables or {})
    prompt = replace(
        chat_prompt(base, conversation(parsed.messages), tools, tool_format),
        chat_template_kwargs=variables,
        thinking_budget=parsed.thinking_token_budget,
    )
    return OpenAIRequest(
        "chat",
        base,
        parsed.model,
        int(time.time()),
        n,
        _choices(base, [prompt], n, sampling, values.cache_salt, tenant=parsed.user),
        stream,
        include_usage,
        k is not None,
        bool(parsed.return_tokens_as_token_ids),
        tools is not None,
        prompt_logprobs=asked,
        asks_thinking=asks_thinking(parsed),
    )


# reasoning efforts that zero thinking satisfies: any model honours them
NO_THINKING_EFFORTS = frozenset({"none", "minimal"})


def asks_thinking(parsed: ChatBody) -> str | None:
    """The first field that asks the model to think (a 400 on a model that does not:
    limits.check_thinking): a reasoning_effort above minimal, enable_thinking true, a thinking
    budget above 0. The forms that ask for no thinking are not named."""
    if parsed.reasoning_effort is not None and parsed.reasoning_effort not in NO_THINKING_EFFORTS:
        return "reasoning_effort"
    if (parsed.chat_template_kwargs or {}).get("enable_thinking"):
        return "chat_template_kwargs.enable_thinking"
    if parsed.thinking_token_budget:
        return "thinking_token_budget"
    return None
