"""Attention over the paged KV cache with torch's ops: the runner's path where the native kernel
does not apply (not bf16, no compiler, `--attention torch`) or cannot (Gemma 2's soft-capped
scores, Gemma 3's sliding-window layers, which it has no masks for).

Decode rows: one query each, plain batched matmuls over each row's gathered keys and values (bf16
SDPA with one query measured 6x slower here), the query heads grouped by the kv head they share
(GQA), kv heads leading so the gathered keys and values are multiplied where they lie. Prompt
chunks: SDPA, or the same product in fp32 where scores are capped (SDPA cannot cap).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from predictor.engine.runners.plan import StepPlan


def decode(
    qkv: torch.Tensor,  # [N, heads + 2 kv_heads, dim]: the decode rows first
    pool: torch.Tensor,  # [2 kv_heads, slots + 1, dim]
    plan: StepPlan,
    heads: int,
    scale: float,
    cap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The decode rows' attention outputs [d, heads * dim]."""
    kv_heads, dim = pool.shape[0] // 2, pool.shape[2]
    d, group = plan.decode_rows, heads // kv_heads
    longest = plan.decode_slots.shape[1]
    kv = pool.index_select(1, plan.decode_slots.view(-1))  # [2 kvh, d L, dim]
    kv = kv.view(2, kv_heads, d, longest, dim)
    query = qkv[:d, :heads].reshape(d, kv_heads, group, dim).transpose(0, 1)
    scores = torch.matmul(query, kv[0].transpose(-1, -2))  # [kv_heads, d, G, L]
    # bias [d, 1, L]: 0 where a key exists, -inf past a row's end; fp32 softmax
    bias = plan.decode_bias if window is None else window_bias(plan.decode_bias, window)
    if cap is not None:
        probs = torch.softmax(torch.add(bias, capped(scores * scale, cap)), -1)
    else:
        probs = torch.softmax(torch.add(bias, scores, alpha=scale), -1)
    attended = torch.matmul(probs.to(kv.dtype), kv[1])  # [kv_heads, d, G, dim]
    return attended.transpose(0, 1).reshape(d, heads * dim)


def prefill(
    query: torch.Tensor,  # [1, heads, Q, dim]
    keys: torch.Tensor,  # [1, kv_heads, T, dim]; the last Q are the queries' own
    values: torch.Tensor,
    mask: torch.Tensor | None,  # SDPA's boolean mask, None: causal from the first key
    scale: float,
    cap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """A prompt chunk's attention [1, heads, Q, dim]."""
    count, total = query.shape[2], keys.shape[2]
    if window is not None and total > window:
        mask = window_mask(count, total, window, query.device)
    if cap is None:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=query.shape[1] != keys.shape[1],
        )  # fmt: skip
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = capped(torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scale, cap)
    if mask is None:  # causal: query i sees the keys up to its own, total - count + i
        mask = torch.ones((count, total), dtype=torch.bool, device=query.device)
        mask = mask.tril(total - count)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    return torch.matmul(probs, values.float()).to(query.dtype)


def capped(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's soft cap: cap * tanh(scores / cap)."""
    return torch.tanh(scores / cap) * cap


def window_bias(bias: torch.Tensor, window: int) -> torch.Tensor:
    """A decode step's bias [d, 1, L] with the keys before each row's window masked too:
    the query at position p sees keys p - window + 1 .. p (transformers' sliding window)."""
    lengths = (bias[:, 0] == 0).sum(-1, keepdim=True)  # [d, 1]: keys in each row
    keys = torch.arange(bias.shape[-1], device=bias.device).unsqueeze(0)  # [1, L]
    return bias.masked_fill((keys < lengths - window).unsqueeze(1), float("-inf"))


def window_mask(count: int, total: int, window: int, device: torch.device) -> torch.Tensor:
    """SDPA's boolean mask [1, 1, count, total] for a row's last `count` queries over its
    `total` keys: causal, and no further back than the window."""
    queries = torch.arange(total - count, total, device=device).unsqueeze(1)
    keys = torch.arange(total, device=device).unsqueeze(0)
    return ((keys <= queries) & (keys > queries - window)).view(1, 1, count, total)
