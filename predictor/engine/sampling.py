"""Logits to token ids, row by row: greedy, temperature, top-k, top-p, one seeded generator each."""

from __future__ import annotations

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


def greedy(logits: torch.Tensor) -> list[int]:
    """argmax of every row of logits [B, V]."""
    return [int(i) for i in logits.argmax(dim=-1).tolist()]


def draw(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """One sampled token id from one row's logits [V] (finite), with the row's own generator."""
    if p.temperature < MIN_TEMPERATURE:  # below float32's reach: the limit is greedy
        return int(logits.argmax())
    # shift so the largest logit is 0 before dividing: a tiny temperature cannot overflow
    scaled = (logits - logits.max()) / p.temperature
    if 0 < p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # drop a token when the tokens before it already reach top_p; the first always stays
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= p.top_p
        drop_sorted[0] = False  # even when top_p rounds to 0 in float32
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """Which rows of logits [B, V] hold only finite numbers (a NaN row must fail alone)."""
    return torch.isfinite(logits).all(dim=-1).tolist()
