"""Logits to token ids for the whole batch in one pass, each row with its own parameters.

Greedy rows take the argmax. Sampled rows are scaled by their temperature, cut to their top-k
and top-p as batched tensor ops, and drawn with the exponential trick torch.multinomial uses
for one sample (argmax of probs / q, q ~ Exp(1) drawn from the row's own generator), so a seed
gives the same tokens alone or in any batch. Penalties, the end-of-sequence ban of min_tokens,
grammars and logprobs cost nothing for rows that don't ask for them. A row with a grammar
(`matcher`, engine/grammar.py) has the tokens its grammar forbids set to -inf after the
penalties and before temperature, top-k and top-p; its logprobs stay the model's raw ones.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from predictor.types import SamplingParams

MIN_TEMPERATURE = 1e-4


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


class RowState(Protocol):
    """What sampling needs to know of one row (the engine's Request has these fields)."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def generator(self) -> Any: ...  # torch.Generator, or None for greedy-only rows
    @property
    def output_ids(self) -> Sequence[int]: ...  # tokens generated so far
    @property
    def prompt_ids(self) -> Sequence[int]: ...  # the prompt's tokens (repetition_penalty)
    @property
    def matcher(self) -> Any: ...  # engine.grammar.Matcher, or None: no grammar


@dataclass
class Row:
    """A plain RowState, for callers without a Sequence."""

    params: SamplingParams
    generator: torch.Generator | None
    output_ids: Sequence[int]
    prompt_ids: Sequence[int] = ()
    matcher: Any = None


NOT_FINITE, NO_TOKEN_ALLOWED = -1, -2  # a row's token when it has none


@dataclass
class Sampled:
    # one per row; NOT_FINITE where the row's logits were not finite, NO_TOKEN_ALLOWED where
    # its grammar allows no token (no text can satisfy it past this point)
    tokens: list[int]
    # per row: (chosen logprob, [(token, logprob)] top alternatives), or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def sample(logits: torch.Tensor, rows: Sequence[RowState], eos_ids: Collection[int]) -> Sampled:
    """logits [B, V] float32 -> one token per row.

    One pass over the logits serves every plain greedy row: its max is both the token and the
    finite check (NaN and +inf propagate into the max). Only rows that sample, are penalized,
    must not end yet (min_tokens) or want logprobs are looked at again. The tokens are read
    back once, at the end (on a GPU: the step's one wait for the device)."""
    best, argmax = row_max(logits)  # [B] each
    chosen = torch.where(torch.isfinite(best), argmax, NOT_FINITE)
    special = [i for i, r in enumerate(rows) if _special(r, eos_ids)]
    if special:
        sub = logits[special]  # [S, V], a copy
        sub_rows = [rows[i] for i in special]
        sub = _penalize(sub, sub_rows)
        sub = _ban_eos(sub, sub_rows, eos_ids)
        dead = _constrain(sub, sub_rows)  # [S] bool, or None: no grammar
        picked = sub.argmax(dim=-1)
        # below float32's reach a temperature's limit is greedy: such rows keep the argmax
        drawn = [j for j, r in enumerate(sub_rows) if r.params.temperature >= MIN_TEMPERATURE]
        if drawn:
            picked[drawn] = _draw(sub[drawn], [sub_rows[j] for j in drawn])
        if dead is not None:
            picked = picked.masked_fill(dead, NO_TOKEN_ALLOWED)
        at = torch.tensor(special, device=logits.device)
        chosen[at] = torch.where(chosen[at] >= 0, picked, NOT_FINITE)
    tokens: list[int] = chosen.tolist()
    return Sampled(tokens, _logprobs(logits, tokens, rows))


def row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max and the index of its first occurrence, as `logits.max(dim=-1)` gives.

    On the CPU torch's max/argmax along a row is not vectorised (several times slower than
    amax over a batch's rows), so the row is cut into blocks: the vectorised amax finds each
    row's best block, and max runs only inside it. Ties and NaN resolve as max does.
    """
    rows, vocab = logits.shape
    block = _block_size(vocab)
    if logits.device.type != "cpu" or block == 0:
        values, indices = logits.max(dim=-1)
        return values, indices
    blocks = logits.view(rows, vocab // block, block)
    best_block = blocks.amax(dim=-1).argmax(dim=-1)  # [B]
    inner = blocks[torch.arange(rows, device=logits.device), best_block]  # [B, block]
    values, indices = inner.max(dim=-1)
    return values, best_block * block + indices


def _block_size(vocab: int) -> int:
    """A divisor of vocab between 512 and 2048 leaving at least 8 blocks; 0 when none."""
    for block in range(512, 2049):
        if vocab % block == 0 and vocab // block >= 8:
            return block
    return 0


def _special(row: RowState, eos_ids: Collection[int]) -> bool:
    p = row.params
    return (
        row.matcher is not None
        or p.temperature >= MIN_TEMPERATURE
        or p.penalized
        or (bool(eos_ids) and not p.ignore_eos and len(row.output_ids) < p.min_tokens)
    )


def _penalize(logits: torch.Tensor, rows: Sequence[RowState]) -> torch.Tensor:
    """The repetition penalty (HF / vLLM: prompt and generated tokens, applied first), then
    OpenAI's logit_bias, presence and frequency penalties over each asking row's tokens."""
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.penalized:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor([*row.prompt_ids, *row.output_ids], device=logits.device)
            seen = seen.unique()
            picked = logits[i, seen]
            logits[i, seen] = torch.where(
                picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty
            )
        if p.logit_bias:  # OpenAI: added to the logits before sampling
            ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], device=logits.device)
            bias = [b for t, b in p.logit_bias if t < vocab]
            logits[i, ids] += torch.tensor(bias, device=logits.device)
        if row.output_ids and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
            ids = torch.tensor(row.output_ids, device=logits.device)
            counts = torch.bincount(ids, minlength=vocab)[:vocab]
            logits[i] -= counts * p.frequency_penalty + (counts > 0) * p.presence_penalty
    return logits


def _ban_eos(
    logits: torch.Tensor, rows: Sequence[RowState], eos_ids: Collection[int]
) -> torch.Tensor:
    """Rows short of min_tokens cannot end: their end-of-sequence logits become -inf."""
    if not eos_ids:
        return logits
    short = [  # a grammar says itself when the text may end
        i
        for i, r in enumerate(rows)
        if not r.params.ignore_eos and len(r.output_ids) < r.params.min_tokens and r.matcher is None
    ]
    if not short:
        return logits
    eos = torch.tensor(sorted(eos_ids), device=logits.device)
    logits[torch.tensor(short, device=logits.device).unsqueeze(1), eos] = float("-inf")
    return logits


def _constrain(logits: torch.Tensor, rows: Sequence[RowState]) -> torch.Tensor | None:
    """Rows with a grammar: the tokens it forbids become -inf, one bitmask for them all (xgrammar's
    CPU kernel). Returns which rows are left with no allowed token (a grammar that cannot go on),
    as a bool tensor [S], or None when no row has a grammar."""
    constrained = [j for j, r in enumerate(rows) if r.matcher is not None]
    if not constrained:
        return None
    import xgrammar as xgr  # only when a row has a grammar

    vocab = logits.shape[-1]
    mask_vocab = rows[constrained[0]].matcher.vocab_size
    bitmask = xgr.allocate_token_bitmask(len(rows), mask_vocab)
    for j in constrained:
        rows[j].matcher.fill(bitmask, j)
    width = min(vocab, mask_vocab)
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device), vocab_size=width, indices=constrained
    )
    if vocab > mask_vocab:  # the model's padding rows: no tokenizer token, never allowed
        logits[constrained, mask_vocab:] = float("-inf")
    return logits.amax(dim=-1) == float("-inf")


def _draw(logits: torch.Tensor, rows: Sequence[RowState]) -> torch.Tensor:
    """Sampled rows only: logits [S, V] -> token ids [S]."""
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in rows], device=device).unsqueeze(1)
    # shift so each row's largest logit is 0 before dividing: a tiny temperature cannot overflow
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    vocab = scaled.shape[-1]
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    if min(top_k) < vocab:
        k = max(top_k)
        kth_index = torch.tensor([t - 1 for t in top_k], device=device).unsqueeze(1)
        kth = torch.topk(scaled, k, dim=-1).values.gather(1, kth_index)  # [S, 1]
        cut = torch.tensor([t < vocab for t in top_k], device=device).unsqueeze(1)
        scaled = scaled.masked_fill(cut & (scaled < kth), float("-inf"))
    top_p = torch.tensor([r.params.top_p for r in rows], device=device).unsqueeze(1)
    if any(r.params.top_p < 1.0 for r in rows):
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs_sorted = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens before it already reach top_p; the first always stays
        drop_sorted = (probs_sorted.cumsum(dim=-1) - probs_sorted) >= top_p
        drop_sorted[:, 0] = False  # even when top_p rounds to 0 in float32
        drop_sorted &= top_p < 1.0
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty_like(probs)
    for i, r in enumerate(rows):  # each row's own stream, as torch.multinomial would draw it
        noise[i].exponential_(1, generator=r.generator)
    return (probs / noise).argmax(dim=-1)


def _logprobs(
    raw: torch.Tensor, tokens: list[int], rows: Sequence[RowState]
) -> list[tuple[float, list[tuple[int, float]]] | None]:
    out: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(rows)
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None and tokens[i] >= 0]
    if not asking:
        return out
    logp = torch.log_softmax(raw[asking], dim=-1)  # [A, V]
    for row, i in enumerate(asking):
        top_n = rows[i].params.logprobs or 0
        top: list[tuple[int, float]] = []
        if top_n:
            values, ids = torch.topk(logp[row], min(top_n, logp.shape[-1]))
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        out[i] = (float(logp[row, tokens[i]]), top)
    return out


def select_rows(logits: torch.Tensor, indexes: Sequence[int]) -> torch.Tensor:
    """logits [R, V] -> [len(indexes), V]: the rows to sample from, when a step also returned
    logits to score prompts with."""
    if len(indexes) == logits.shape[0]:
        return logits
    return logits.index_select(0, torch.tensor(indexes, dtype=torch.long, device=logits.device))


def score_tokens(
    logits: torch.Tensor, targets: Sequence[int], top_n: int
) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """logits [T, V] (position t's) and the token that follows each position -> per position:
    (the token's logprob, its rank (1: the most likely), the top_n most likely (token, logprob)).

    The model's raw distribution, as sampled tokens' logprobs are (no temperature, no
    penalties): a prompt is scored the same whatever the request samples with."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [T, V]
    at = torch.tensor(targets, dtype=torch.long, device=logp.device).unsqueeze(1)  # [T, 1]
    chosen = logp.gather(1, at)  # [T, 1]
    ranks = ((logp > chosen).sum(dim=1) + 1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in targets]
    if top_n:
        values, ids = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)  # [T, k] each
        pairs = zip(ids.tolist(), values.tolist(), strict=True)
        tops = [list(zip(i, v, strict=True)) for i, v in pairs]
    return list(zip(chosen[:, 0].tolist(), ranks, tops, strict=True))
