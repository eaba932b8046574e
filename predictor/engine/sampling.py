"""Logits to token ids, row by row: greedy, temperature, top-k, top-p, one seeded generator each."""

from __future__ import annotations

import torch

from predictor.types import SamplingParams


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor,  # [B, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[int]:
    """One token id per row. Greedy rows take argmax; the others draw with their own generator."""
    greedy_ids = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            out.append(int(greedy_ids[row]))
        else:
            out.append(_draw(logits[row], p, generator))
    return out


def _draw(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    # logits: [V]
    scaled = logits / p.temperature
    if 0 < p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # drop a token when the tokens before it already reach top_p; the first always stays
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """Which rows of logits [B, V] hold only finite numbers (a NaN row must fail alone)."""
    return torch.isfinite(logits).all(dim=-1).tolist()
