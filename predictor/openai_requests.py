"""OpenAI completions and chat completions request bodies -> our types.

Bodies are checked by strict pydantic models: a wrong type, a value out of range or a field we
do not know is an `InvalidField` naming it. Fields OpenAI defines that we cannot honour (tools,
logit_bias, echo, ...) are refused by name unless they hold their harmless default. The routes
and response shapes are in `openai_responses` and `server/openai.py`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from predictor.codecs import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from predictor.errors import InvalidRequest
from predictor.types import GenerateRequest, SamplingParams

MAX_CHOICES = 16  # n, and the number of prompts in one completions request
MAX_TOP_LOGPROBS = 20
SEED_MODULUS = 2**63  # choice j of a seeded request uses (seed + j) mod 2**63


class InvalidField(InvalidRequest):
    """A bad request body, naming the offending field (OpenAI's error `param`)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


# -- body models --------------------------------------------------------------------------------

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Common(_Strict):
    """Fields completions and chat completions share (OpenAI's, then vLLM's extensions)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: Stop | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_MODULUS)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted: an end-user id, for the client's own bookkeeping
    top_k: int | None = Field(None, ge=-1)  # vLLM: -1 or 0 turn it off
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    return_tokens_as_token_ids: bool | None = None  # vLLM: logprob tokens as "token_id:{id}"
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # vLLM: prefix cache


class CompletionBody(_Common):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[
            list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)
        ]
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]


class ChatBody(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


def _empty(value: Any) -> bool:
    return value in ([], {})


# OpenAI fields we cannot honour: refused by name unless they hold a value that asks for nothing.
_HARMLESS: dict[str, Callable[[Any], bool]] = {
    "tools": _empty,
    "functions": _empty,
    "tool_choice": lambda v: v == "none",
    "function_call": lambda v: v == "none",
    "parallel_tool_calls": lambda v: isinstance(v, bool),  # only matters with tools
    "response_format": lambda v: v == {"type": "text"},
    "logit_bias": _empty,
    "echo": lambda v: v is False,
    "suffix": lambda v: v == "",
    "modalities": lambda v: v == ["text"],
    "store": lambda v: v is False,
    "service_tier": lambda v: v in ("auto", "default"),
    "audio": lambda v: False,
    "prediction": lambda v: False,
    "reasoning_effort": lambda v: False,
    "web_search_options": lambda v: False,
    "metadata": lambda v: False,
}


def _without_refused(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidField(None, "the request body must be a JSON object")
    kept: dict[str, Any] = {}
    for key, value in body.items():
        if value is None:  # JSON null: the default, for every optional field
            continue
        harmless = _HARMLESS.get(key)
        if harmless is not None:
            if not harmless(value):
                raise InvalidField(key, f"'{key}' is not supported by this server")
            continue
        kept[key] = value
    return kept


def _param(loc: tuple[int | str, ...], names: frozenset[str]) -> str:
    """A pydantic error location as OpenAI names a param: messages[2].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in names:  # skips pydantic's union-member tags ('str', 'list[str]', ...)
            out += f".{part}" if out else part
    return out


_FIELD_NAMES = frozenset(
    name
    for model in (CompletionBody, ChatBody, Message, TextPart, StreamOptions)
    for name in model.model_fields
)


Body = TypeVar("Body", bound=_Common)


def _validate(model: type[Body], body: Any) -> Body:
    try:
        return model.model_validate(_without_refused(body))
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = error["loc"]
        if error["type"] == "extra_forbidden":  # the unknown key itself is the last part
            param = _param(loc, _FIELD_NAMES | {str(loc[-1])})
            raise InvalidField(param, f"'{param}' is not supported by this server") from exc
        param = _param(loc, _FIELD_NAMES)
        raise InvalidField(param or None, f"'{param}': {error['msg']}") from exc


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


def _sampling(
    body: _Common, max_tokens: int | None, default_max_tokens: int, logprobs: int | None
) -> SamplingParams:
    max_tokens = max_tokens or default_max_tokens
    min_tokens = body.min_tokens or 0
    if min_tokens > max_tokens:
        raise InvalidField(
            "min_tokens", f"'min_tokens' ({min_tokens}) exceeds the token cap ({max_tokens})"
        )
    stop = body.stop if body.stop is not None else ()
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature if body.temperature is not None else 1.0,
        top_p=body.top_p if body.top_p is not None else 1.0,
        top_k=max(body.top_k or 0, 0),
        seed=body.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        ignore_eos=bool(body.ignore_eos),
        min_tokens=min_tokens,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logprobs=logprobs,
    )


def _stream_flags(body: _Common) -> tuple[bool, bool]:
    stream = bool(body.stream)
    if body.stream_options is not None and not stream:
        raise InvalidField("stream_options", "'stream_options' is only allowed with stream: true")
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return stream, include_usage


def _choices(
    base: str,
    prompts: list[GenerateRequest],
    n: int,
    sampling: SamplingParams,
    salt: str | None = None,
) -> tuple[GenerateRequest, ...]:
    out = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            seed = None if sampling.seed is None else (sampling.seed + j) % SEED_MODULUS
            params = replace(sampling, seed=seed) if seed != sampling.seed else sampling
            rid = base if len(prompts) * n == 1 else f"{base}-{i * n + j}"
            out.append(
                GenerateRequest(
                    rid,
                    prompt.prompt,
                    params,
                    prompt.chat,
                    messages=prompt.messages,
                    cache_salt=salt,
                )
            )
    return tuple(out)


def decode_completion(body: Any, default_max_tokens: int) -> OpenAIRequest:
    parsed = _validate(CompletionBody, body)
    n = parsed.n or 1
    if parsed.best_of is not None and parsed.best_of != n:
        raise InvalidField("best_of", f"'best_of' must equal n ({n}) on this server")
    sampling = _sampling(parsed, parsed.max_tokens, default_max_tokens, parsed.logprobs)
    stream, include_usage = _stream_flags(parsed)
    texts = [parsed.prompt] if isinstance(parsed.prompt, str) else parsed.prompt
    base = f"cmpl-{uuid.uuid4().hex}"
    prompts = [GenerateRequest(base, text) for text in texts]
    return OpenAIRequest(
        "completion", base, parsed.model, int(time.time()), n,
        _choices(base, prompts, n, sampling, parsed.cache_salt), stream, include_usage,
        parsed.logprobs is not None,
        bool(parsed.return_tokens_as_token_ids),
    )  # fmt: skip


def _content(message: Message) -> str:
    if isinstance(message.content, str):
        return message.content
    return "\n".join(part.text for part in message.content)  # text parts, as vLLM joins them


def decode_chat(body: Any, default_max_tokens: int) -> OpenAIRequest:
    parsed = _validate(ChatBody, body)
    n = parsed.n or 1
    if parsed.top_logprobs is not None and not parsed.logprobs:
        raise InvalidField("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    if (
        parsed.max_tokens is not None
        and parsed.max_completion_tokens is not None
        and parsed.max_tokens != parsed.max_completion_tokens
    ):
        raise InvalidField("max_tokens", "'max_tokens' and 'max_completion_tokens' disagree")
    k = (parsed.top_logprobs or 0) if parsed.logprobs else None
    max_tokens = parsed.max_completion_tokens or parsed.max_tokens
    sampling = _sampling(parsed, max_tokens, default_max_tokens, k)
    stream, include_usage = _stream_flags(parsed)
    messages = tuple({"role": m.role, "content": _content(m)} for m in parsed.messages)
    base = f"chatcmpl-{uuid.uuid4().hex}"
    if len(messages) == 1 and messages[0]["role"] == "user":
        # the engine's own single-message chat path renders the same template
        prompt = GenerateRequest(base, messages[0]["content"], chat=True, messages=messages)
    else:
        prompt = GenerateRequest(base, "", chat=True, messages=messages)
    return OpenAIRequest(
        "chat", base, parsed.model, int(time.time()), n,
        _choices(base, [prompt], n, sampling, parsed.cache_salt), stream, include_usage,
        k is not None,
        bool(parsed.return_tokens_as_token_ids),
    )  # fmt: skip


def _inline_refs(schema: Any, defs: dict[str, Any]) -> Any:
    """A JSON schema with its $refs replaced by their definitions (the OpenAPI document has
    no place for pydantic's $defs)."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            return _inline_refs(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
        return {k: _inline_refs(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline_refs(v, defs) for v in schema]
    return schema


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    return dict(_inline_refs(schema, schema.get("$defs", {})))


COMPLETION_SCHEMA = body_schema(CompletionBody)
CHAT_SCHEMA = body_schema(ChatBody)
