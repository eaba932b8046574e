"""Our logprobs -> OpenAI's shapes: completions' legacy parallel lists (with echo's prompt
tokens), chat's token objects, and vLLM's prompt_logprobs. `responses.py` puts them in the
answers and chunks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from openai.types.chat import ChatCompletionTokenLogprob
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs

from predictor.protocols.openai.requests import OpenAIRequest
from predictor.types import PromptEcho, PromptToken, TokenLogprob
from predictor.types import TopLogprob as OurTopLogprob


def _top_k(request: OpenAIRequest) -> int:
    return request.choices[0].params.logprobs or 0


def _text(request: OpenAIRequest, token: TokenLogprob | OurTopLogprob | PromptToken) -> str:
    return f"token_id:{token.token_id}" if request.token_ids else token.token


def completion_logprobs(
    request: OpenAIRequest,
    tokens: Sequence[TokenLogprob],
    offset: int = 0,
    prompt: PromptEcho | None = None,
) -> Logprobs:
    """The legacy shape: parallel lists; text_offset counts characters of the choice's text.
    With echo (`prompt`), the prompt's tokens lead, the first with null logprob and
    top_logprobs (nothing precedes it), as OpenAI and vLLM send them."""
    k = _top_k(request)
    scored: list[PromptToken | TokenLogprob] = [*(prompt.logprobs if prompt else ()), *tokens]
    offsets = []
    for t in scored:
        offsets.append(offset)
        offset += len(t.token)
    top = (
        [
            None if t.logprob is None else {_text(request, x): x.logprob for x in t.top[:k]}
            for t in scored
        ]
        if k
        else None
    )
    # model_construct: the SDK's type has no null entries, OpenAI's echo sends them
    return Logprobs.model_construct(
        tokens=[_text(request, t) for t in scored],
        token_logprobs=[t.logprob for t in scored],
        top_logprobs=top,
        text_offset=offsets,
    )


def prompt_logprobs(request: OpenAIRequest, prompt: PromptEcho | None) -> list[Any]:
    """vLLM's prompt_logprobs: per prompt token null (the first) or {token id: {logprob, rank,
    decoded_token}} for the token itself and the k most likely at its position."""
    k = request.prompt_logprobs or 0
    out: list[Any] = []
    for t in prompt.logprobs if prompt is not None else ():
        if t.logprob is None:
            out.append(None)
            continue
        entry = {str(t.token_id): _prompt_entry(request, t, t.logprob, t.rank)}
        for rank, x in enumerate(t.top[:k], start=1):
            entry.setdefault(str(x.token_id), _prompt_entry(request, x, x.logprob, rank))
        out.append(entry)
    return out


def _prompt_entry(
    request: OpenAIRequest, token: PromptToken | OurTopLogprob, logprob: float, rank: int | None
) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": _text(request, token)}


def chat_logprobs(
    request: OpenAIRequest, tokens: Sequence[TokenLogprob]
) -> list[ChatCompletionTokenLogprob]:
    return [
        ChatCompletionTokenLogprob(
            token=_text(request, t),
            bytes=list(t.token.encode()),
            logprob=t.logprob,
            top_logprobs=[
                TopLogprob(token=_text(request, x), bytes=list(x.token.encode()), logprob=x.logprob)
                for x in t.top
            ],
        )
        for t in tokens
    ]
