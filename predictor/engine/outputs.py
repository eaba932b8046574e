"""A step's sampled tokens applied to their requests: what the step loop does with logits.

`accept` samples each row's next token (engine/sampling.py) and advances its request: the
grammar's and the thinking budget's say, eos (after min_tokens), stop strings, max_tokens, its
logprobs, and the event the row sends. `verify` keeps a row's drafts while the token sampled
at a draft's position is that draft (the same tokens as without drafts), and `score` scores a
prompt's tokens (prompt_logprobs). The step loop decides which rows of `logits` are whose; this
module decides what a token does to its request.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from predictor.engine.request import Request
from predictor.engine.sampling import NO_TOKEN_ALLOWED, sample, score_tokens, select_rows
from predictor.engine.step import StepRow
from predictor.types import FinishReason, PromptToken, TokenLogprob, TopLogprob

if TYPE_CHECKING:  # annotations only: the runners run torch
    import torch

log = logging.getLogger(__name__)


@dataclass
class Verified:
    """What one step's drafts came to."""

    rows: int = 0  # rows that verified drafts
    drafts: int = 0  # draft tokens verified
    accepted: list[int] = field(default_factory=list)  # per verifying row, drafts kept
    per_position: tuple[int, ...] = ()  # rows whose draft at each position was kept


class Outputs:
    """Tokens sampled and applied to their requests, for one engine's end-of-text ids."""

    def __init__(self, eos_ids: Collection[int]) -> None:
        self._eos_ids = frozenset(eos_ids)

    def verify(self, verifying: list[tuple[Request, int, list[int]]], logits: Any) -> Verified:
        """Keep each row's drafts while the token sampled at a draft's position is that draft
        (the sampler, each row's generator and state as if no draft was made: the rejection
        rule of a deterministic draft in one draw); the first token that differs, or the one
        after the last draft, is the row's own next token. The same tokens as without drafts."""
        accepted = [0] * len(verifying)
        active = list(range(len(verifying)))
        position = 0  # the draft the token just sampled is compared with
        while active:
            kept = []
            for v in active:
                request, _, drafts = verifying[v]
                if request.output_ids[-1] == drafts[position]:
                    accepted[v] += 1
                    if request.finish_reason is None:
                        kept.append(v)
            position += 1
            if not kept:
                break
            rows = [verifying[v][1] + position for v in kept]  # the token after the draft
            nexts = [
                d[position] if position < len(d) else None for d in (verifying[v][2] for v in kept)
            ]
            self.accept([verifying[v][0] for v in kept], select_rows(logits, rows), nexts)
            active = [v for v in kept if position < len(verifying[v][2])]
        per_position = [0] * max((len(d) for _, _, d in verifying), default=0)
        for (request, _, drafts), count in zip(verifying, accepted, strict=True):
            assert request.speculation is not None
            request.speculation.observe(len(drafts), count)
            for p in range(count):
                per_position[p] += 1
        return Verified(
            rows=len(verifying),
            drafts=sum(len(d) for _, _, d in verifying),
            accepted=accepted,
            per_position=tuple(per_position),
        )

    def accept(
        self, requests: list[Request], logits: torch.Tensor, drafts: list[int | None] | None = None
    ) -> None:
        """Sample each row's next token from its logits [len(requests), V] and advance it;
        `drafts`: the draft each row's token is checked against, if any (counted accepted
        before the token's event, which may be its last)."""
        try:
            result = sample(logits, requests, self._eos_ids)
        except Exception:  # a sampling bug must fail these rows, not the engine
            log.exception("sampling failed")
            for request in requests:
                request.finish(FinishReason.ERROR, error="sampling failed")
            return
        rows = zip(requests, result.tokens, result.logprobs, strict=True)
        for i, (request, token, logprob) in enumerate(rows):
            if token == NO_TOKEN_ALLOWED and request.params.grammar is not None:
                param = request.params.grammar.param  # the request's constraint, not the model
                request.finish(
                    FinishReason.ERROR,
                    request.detokenizer.flush(),
                    error_param=param,
                    error=f"no text satisfies '{param}' past what was generated: it "
                    "allows no next token",
                )
                continue
            if token < 0:
                request.finish(FinishReason.ERROR, error="the model produced non-finite logits")
                continue
            if request.thinking is not None:  # its thinking budget spent: the end tag
                token = request.thinking.steer(token)
            logprobs: tuple[TokenLogprob, ...] = ()
            if logprob is not None:
                logprobs = (self._token_logprob(request, token, *logprob),)
            if drafts is not None and drafts[i] == token:
                request.accepted_tokens += 1
            self._advance(request, token, logprobs)

    @staticmethod
    def score(request: Request, row: StepRow, logits: torch.Tensor) -> None:
        """Score the prompt tokens that follow this chunk's positions (logits [len(tokens),
        V]: position start + i's), skipping those scored before a preemption."""
        scores = request.prompt_scores
        skip = len(scores) - 1 - row.start  # positions already scored
        targets = request.prompt_ids[len(scores) : row.start + len(row.tokens) + 1]
        if skip < 0 or not targets:
            return
        k = request.params.prompt_logprobs or 0
        text = request.detokenizer.token_text
        scored = score_tokens(logits[skip : skip + len(targets)], targets, k)
        for token, (logprob, rank, top) in zip(targets, scored, strict=True):
            tops = tuple(TopLogprob(t, text(t), lp) for t, lp in top)
            scores.append(PromptToken(token, text(token), logprob, rank, tops))

    @staticmethod
    def _token_logprob(
        request: Request, token: int, logprob: float, top: list[tuple[int, float]]
    ) -> TokenLogprob:
        text = request.detokenizer.token_text
        return TokenLogprob(
            token, text(token), logprob, tuple(TopLogprob(t, text(t), lp) for t, lp in top)
        )

    def _advance(self, request: Request, token: int, logprobs: tuple[TokenLogprob, ...]) -> None:
        request.output_ids.append(token)
        ids = (token,)
        generated = len(request.output_ids)
        # min_tokens (vLLM's meaning): eos may end the request only after that many tokens,
        # stop strings are looked for once that many exist
        eos_armed = generated > request.params.min_tokens and not request.params.ignore_eos
        matcher = request.matcher
        if matcher is not None:  # the grammar says when the text ends: eos is its end
            if not matcher.accept(token):
                request.finish(FinishReason.ERROR, error="the grammar refused the sampled token")
                return
            eos_armed = True
        if request.thinking is not None:  # the grammar waits for the thinking to end
            request.follow_thinking(token)
        if token in self._eos_ids and eos_armed:
            request.finish(
                FinishReason.EOS, request.detokenizer.flush(), token_ids=ids, logprobs=logprobs
            )
            return
        text = request.detokenizer.push(token, check_stop=generated >= request.params.min_tokens)
        if matcher is not None and not request.detokenizer.stopped and matcher.finished:
            text += request.detokenizer.flush()
            request.finish(FinishReason.EOS, text, token_ids=ids, logprobs=logprobs)
        elif request.detokenizer.stopped:
            request.finish(
                FinishReason.STOP,
                text,
                token_ids=ids,
                logprobs=logprobs,
                stop_sequence=request.detokenizer.matched,
            )
        elif generated >= request.params.max_tokens:
            text += request.detokenizer.flush()
            request.finish(FinishReason.LENGTH, text, token_ids=ids, logprobs=logprobs)
        else:
            request.emit(text, ids, logprobs)
