"""Attention over the paged KV cache, one object chosen at start (`choose`): the native kernel's
(`NativeAttention`: rotary and the cache write in one C call, decode rows read in place;
`NativeDecodeAttention` where only the decode kernel applies) or torch's (`TorchAttention`).
Each writes a step's new keys and values into the layer's pool and returns the attended rows;
prompt chunks attend through `prefill` in all three.

Torch's path is the runner's where the native kernel does not apply (not bf16, no compiler,
`--attention torch`) or cannot (Gemma 2's soft-capped scores, Gemma 3's sliding-window layers,
which it has no masks for). Decode rows: one query each, plain batched matmuls over each row's
gathered keys and values (bf16 SDPA with one query is slower), the query heads
grouped by the kv head they share (GQA), kv heads leading so the gathered keys and values are
multiplied where they lie. Prompt chunks: SDPA, or the same product in fp32 where scores are
capped (SDPA cannot cap).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from predictor.config import ATTENTION
from predictor.engine.runners.family import HeadSizes
from predictor.engine.runners.native.bindings import DecodeAttention, decode_attention
from predictor.engine.runners.native.layer_kernels import LayerKernels
from predictor.engine.runners.plan import StepPlan
from predictor.errors import NativeUnavailable

logger = logging.getLogger(__name__)

Rope = tuple[torch.Tensor, torch.Tensor]  # a layer's cos and sin tables for the step


class TorchAttention:
    """q and k rotated and k, v written with torch's ops; decode rows by `decode`."""

    native = False  # StepPlan's decode rows: one query each, slots and bias for torch

    def __init__(
        self,
        sizes: HeadSizes,
        rotary: Any,
        rope_kinds: list[str | None],
        cap: float | None,
        windows: list[int | None],
        device: torch.device,
    ) -> None:
        self._sizes, self._rotary, self._rope_kinds = sizes, rotary, rope_kinds
        self._cap, self._windows, self._device = cap, windows, device

    def tables(self, hidden: torch.Tensor, positions: list[int]) -> list[Rope]:
        """Each layer's rotary tables for the step (one per layer type, shared)."""
        ropes = {kind: self._rope(hidden, positions, kind) for kind in set(self._rope_kinds)}
        return [ropes[kind] for kind in self._rope_kinds]

    def _rope(self, hidden: torch.Tensor, positions: list[int], kind: str | None = None) -> Rope:
        """cos and sin tables [N, heads + 2 kv_heads, head_dim] that rotate q and k and leave v
        as it is (cos 1, sin 0), sin's first half negated, for `_write`'s single pass (`kind`:
        the layer type whose table, where the model has one per type)."""
        heads, kv_heads, dim = self._sizes.heads, self._sizes.kv_heads, self._sizes.head_dim
        at = torch.tensor(positions, dtype=torch.long, device=self._device).unsqueeze(0)
        if kind is None:
            cos, sin = self._rotary(hidden.unsqueeze(0), at)  # [1, N, head_dim] each
        else:
            cos, sin = self._rotary(hidden.unsqueeze(0), at, kind)
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)
        half, rotated = dim // 2, heads + kv_heads
        shape = (hidden.shape[0], rotated + kv_heads, dim)
        cos_all = torch.ones(shape, dtype=cos.dtype, device=self._device)
        sin_all = torch.zeros(shape, dtype=sin.dtype, device=self._device)
        cos_all[:, :rotated] = cos
        sin_all[:, :rotated, :half] = -sin[..., :half]
        sin_all[:, :rotated, half:] = sin[..., half:]
        return cos_all, sin_all

    def __call__(
        self,
        index: int,
        qkv: torch.Tensor,  # [N, (heads + 2 kv_heads) * dim]
        pool: torch.Tensor,  # [2 kv_heads, slots + 1, dim]
        rope: Rope,
        plan: StepPlan,
    ) -> torch.Tensor:
        """Layer `index`'s attention [N, heads * dim], its new keys and values written."""
        qkv = self._write(qkv, pool, rope, plan)  # [N, heads + 2 kv_heads, dim]
        out = torch.empty(
            (qkv.shape[0], self._sizes.heads * self._sizes.head_dim),
            dtype=qkv.dtype,
            device=qkv.device,
        )
        if plan.decode_rows:
            self._decode(index, qkv, pool, plan, out)
        prefills(qkv, pool, plan, self._sizes, out, self._cap, self._windows[index])
        return out

    def _write(
        self, qkv: torch.Tensor, pool: torch.Tensor, rope: Rope, plan: StepPlan
    ) -> torch.Tensor:
        """q and k rotated, k and v written to their slots: the rotated [N, heads + 2 kv_heads,
        dim]. Rotary as transformers' x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2,
        x1) = (x2, x1) * (-1, 1); v passes through (cos 1, sin 0)."""
        n, heads, kv_heads = qkv.shape[0], self._sizes.heads, self._sizes.kv_heads
        dim, (cos, sin) = self._sizes.head_dim, rope
        qkv = qkv.view(n, heads + 2 * kv_heads, dim)
        swapped = qkv.view(n, heads + 2 * kv_heads, 2, dim // 2).flip(2).view_as(qkv)
        qkv = qkv * cos + swapped * sin
        pool.index_copy_(1, plan.write_slots, qkv[:, heads:].transpose(0, 1))
        return qkv

    def _decode(
        self, index: int, qkv: torch.Tensor, pool: torch.Tensor, plan: StepPlan, out: torch.Tensor
    ) -> None:
        out[: plan.decode_rows] = decode(
            qkv, pool, plan, self._sizes.heads, self._sizes.scale, self._cap, self._windows[index]
        )


class NativeDecodeAttention(TorchAttention):
    """Decode rows (and every token, with --batch-invariant: plan.py's `queries_as_decode`) by
    decode_attention.c, reading each row's blocks where they lie; rotary and the cache write
    torch's (where the native layer ops do not apply)."""

    native = True  # StepPlan's decode rows: block tables, lengths and counts for the kernel

    def __init__(
        self,
        sizes: HeadSizes,
        rotary: Any,
        rope_kinds: list[str | None],
        windows: list[int | None],
        device: torch.device,
        kernel: DecodeAttention,
    ) -> None:
        super().__init__(sizes, rotary, rope_kinds, None, windows, device)
        self._kernel = kernel

    def _decode(
        self, index: int, qkv: torch.Tensor, pool: torch.Tensor, plan: StepPlan, out: torch.Tensor
    ) -> None:
        tables, lengths, counts, scratch = plan.native_args
        self._kernel(
            qkv,
            pool,
            tables,
            lengths,
            counts,
            len(lengths),
            self._sizes.scale,
            out,
            scratch,
            torch.get_num_threads(),  # --threads, on the step thread
        )


class NativeAttention(NativeDecodeAttention):
    """The native decode kernel, and rotary with the cache write in one call (layer_ops.c)."""

    def __init__(
        self,
        sizes: HeadSizes,
        rotary: Any,
        rope_kinds: list[str | None],
        windows: list[int | None],
        device: torch.device,
        kernel: DecodeAttention,
        ops: LayerKernels,
    ) -> None:
        super().__init__(sizes, rotary, rope_kinds, windows, device, kernel)
        self._ops = ops

    def tables(self, hidden: torch.Tensor, positions: list[int]) -> list[Rope]:
        """cos and sin [N, head_dim] each, in the model's dtype: one table for every layer."""
        at = torch.tensor(positions, dtype=torch.long, device=self._device).unsqueeze(0)
        cos, sin = self._rotary(hidden.unsqueeze(0), at)  # [1, N, head_dim] each
        rope = (cos[0].to(hidden.dtype).contiguous(), sin[0].to(hidden.dtype).contiguous())
        return [rope] * len(self._rope_kinds)

    def _write(
        self, qkv: torch.Tensor, pool: torch.Tensor, rope: Rope, plan: StepPlan
    ) -> torch.Tensor:
        n, heads, kv_heads = qkv.shape[0], self._sizes.heads, self._sizes.kv_heads
        qkv = qkv.contiguous().view(n, heads + 2 * kv_heads, self._sizes.head_dim)
        self._ops.rope_write(qkv, heads, kv_heads, *rope, pool, plan.write_slots)
        return qkv


def choose(
    sizes: HeadSizes,
    rotary: Any,
    rope_kinds: list[str | None],
    cap: float | None,
    windows: list[int | None],
    device: torch.device,
    kernel: DecodeAttention | None,
    ops: LayerKernels | None,
) -> TorchAttention:
    """The runner's attention, once at start: torch's without the native decode `kernel`
    (`native_kernel`), else the kernel's, with the native rotary and cache write where the
    layer ops (`ops`) apply too."""
    if kernel is None:
        return TorchAttention(sizes, rotary, rope_kinds, cap, windows, device)
    if ops is None:
        return NativeDecodeAttention(sizes, rotary, rope_kinds, windows, device, kernel)
    return NativeAttention(sizes, rotary, rope_kinds, windows, device, kernel, ops)


def native_kernel(
    attention: str,
    sizes: HeadSizes,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    cap: float | None,
    windows: list[int | None],
    library_cache: Path | None,
) -> DecodeAttention | None:
    """The native decode kernel for `attention` (config.ATTENTION: "native" demands it and
    fails saying why; "auto" takes it where it applies and compiles), or None: torch's."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, not {attention!r}")
    if attention == "triton":
        raise ValueError("triton attention is the GPU runner's (--device cuda)")
    if attention == "torch":
        return None
    if device.type != "cpu" or dtype != torch.bfloat16:
        if attention == "native":
            raise ValueError("native attention needs a bf16 model on the CPU")
        return None
    if cap is not None or any(windows):
        if attention == "native":
            raise ValueError(
                "native attention has no soft-capping of scores (Gemma 2) nor sliding "
                "window masks (Gemma 3)"
            )
        return None
    try:
        return decode_attention(
            sizes.head_dim, sizes.heads // sizes.kv_heads, block_size, library_cache
        )
    except NativeUnavailable as error:
        if attention == "native":
            raise
        logger.warning("native decode attention unavailable, using torch's: %s", error)
        return None


def prefills(
    qkv: torch.Tensor,  # [N, heads + 2 kv_heads, dim], rotated
    pool: torch.Tensor,
    plan: StepPlan,
    sizes: HeadSizes,
    out: torch.Tensor,  # [N, heads * dim]: each prompt chunk's rows written
    cap: float | None = None,
    window: int | None = None,
) -> None:
    """The step's prompt chunks (the rows not attended as decode rows), each by `prefill`."""
    heads, kv_heads, dim = sizes.heads, sizes.kv_heads, sizes.head_dim
    for first, count, slots, mask in plan.prefills:
        query = qkv[first : first + count, :heads].transpose(0, 1).unsqueeze(0)
        kv = pool.index_select(1, slots).unsqueeze(0)  # [1, 2 kv_heads, T, dim]
        attended = prefill(
            query, kv[:, :kv_heads], kv[:, kv_heads:], mask, sizes.scale, cap, window
        )
        out[first : first + count] = attended[0].transpose(0, 1).reshape(count, heads * dim)


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
            query,
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=query.shape[1] != keys.shape[1],
        )
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
