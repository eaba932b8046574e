"""The GPU runner's attention paths besides the paged Triton kernel (triton_ops.py): a prompt
chunk's queries through torch SDPA over the row's gathered keys and values, decode rows through
torch's gather and batched matmuls, and the measurement at start that picks, for eager decode
steps, the faster of the kernel and the gather (a graph always runs the kernel: its shapes must
not move)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from predictor.engine.runners.cuda import triton_ops

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Heads:
    """The attention's shape: query heads, kv heads, head size, scale, cache block size."""

    heads: int
    kv_heads: int
    dim: int
    scale: float
    block_size: int


def prefill(
    heads: Heads,
    qkv: torch.Tensor,
    pool: torch.Tensor,
    first: int,
    count: int,
    start: int,
    slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """A prompt chunk's queries (flat rows first..first + count) against the row's keys
    0..start + count - 1 (`slots`), written into `out`."""
    h, kvh, dim, device = heads.heads, heads.kv_heads, heads.dim, qkv.device
    rows = qkv[first : first + count, : h * dim].view(count, h, dim)
    query = rows.transpose(0, 1).unsqueeze(0)  # [1, heads, count, dim]
    kv = pool.index_select(1, slots).unsqueeze(0)  # [1, 2 kv_heads, end, dim]
    mask = None
    if start:  # query i (position start + i) sees keys 0..start + i
        end = start + count
        keys_at = torch.arange(end, device=device)
        queries_at = torch.arange(start, end, device=device).unsqueeze(1)
        mask = (keys_at <= queries_at).view(1, 1, count, end)
    attended = F.scaled_dot_product_attention(
        query,
        kv[:, :kvh],
        kv[:, kvh:],
        attn_mask=mask,
        is_causal=mask is None,
        scale=heads.scale,
        enable_gqa=h != kvh,
    )
    out[first : first + count] = attended[0].transpose(0, 1).reshape(count, h * dim)


def torch_decode(
    heads: Heads,
    qkv: torch.Tensor,
    pool: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    pad_slot: int,
) -> None:
    """Decode attention in torch ops: each row's slots gathered, batched matmuls."""
    d, kvh, dim, size, device = (
        qkv.shape[0],
        heads.kv_heads,
        heads.dim,
        heads.block_size,
        qkv.device,
    )
    group = heads.heads // kvh
    longest = tables.shape[1] * size
    offsets = torch.arange(size, device=device).repeat(tables.shape[1])
    slots = (tables.long() * size).repeat_interleave(size, 1) + offsets
    missing = torch.arange(longest, device=device) >= lengths.long().unsqueeze(1)
    slots = slots.masked_fill(missing, pad_slot)  # [d, L]
    bias = torch.zeros((d, 1, longest), device=device)
    bias = bias.masked_fill(missing.unsqueeze(1), float("-inf"))
    kv = pool.index_select(1, slots.view(-1)).view(2, kvh, d, longest, dim)
    query = qkv[:, : heads.heads * dim].reshape(d, kvh, group, dim).transpose(0, 1)
    scores = torch.matmul(query, kv[0].transpose(-1, -2))  # [kv_heads, d, G, L]
    probs = torch.softmax(torch.add(bias, scores.float(), alpha=heads.scale), -1)
    attended = torch.matmul(probs.to(kv.dtype), kv[1])  # [kv_heads, d, G, dim]
    out.copy_(attended.transpose(0, 1).reshape(d, heads.heads * dim))


def choose(heads: Heads, pool: torch.Tensor, rows: int, num_blocks: int, pad_slot: int) -> str:
    """ "triton" or "torch" for eager decode steps, by measurement at `rows` rows of 512 keys."""
    keys = 512
    per_row = -(-keys // heads.block_size)
    if rows * per_row > num_blocks:
        return "triton"
    device, dtype = pool.device, pool.dtype
    tables = torch.arange(rows * per_row, dtype=torch.int32, device=device).view(rows, per_row)
    lengths = torch.full((rows,), keys, dtype=torch.int32, device=device)
    width = (heads.heads + 2 * heads.kv_heads) * heads.dim
    qkv = torch.randn((rows, width), device=device).to(dtype)
    out = torch.empty((rows, heads.heads * heads.dim), dtype=dtype, device=device)
    paths = {
        "triton": lambda: triton_ops.paged_decode_attention(
            qkv,
            pool,
            tables,
            lengths,
            out,
            heads.heads,
            heads.kv_heads,
            heads.block_size,
            heads.scale,
        ),
        "torch": lambda: torch_decode(heads, qkv, pool, tables, lengths, out, pad_slot),
    }
    figures = {name: _time_eager(run) for name, run in paths.items()}
    choice = min(figures, key=figures.__getitem__)
    logger.info(
        "GPU decode attention (eager steps): %s (%s at %d rows x %d keys)",
        choice,
        ", ".join(f"{n} {t:.0f} us" for n, t in figures.items()),
        rows,
        keys,
    )
    return choice


def _time_eager(run: Callable[[], None], repeats: int = 20) -> float:
    """Microseconds a call takes, launches included (eager steps pay them)."""
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / repeats * 1e6)
    return statistics.median(times)
