"""GPTQ's packed tensors: the one place their bit layout is written down.

qweight [K * bits / 32, N] int32 holds input row k's code at bits * (k % (32 / bits)) of word
k // (32 / bits); qzeros [groups, N * bits / 32] packs the zero points the same way along the
columns; a weight is scale * (code - zero) of its group. The checkpoint format `gptq` (v1)
stores each zero point minus one, subtracted word-wide (gptqmodel writes it so from its v2);
`gptq_v2` stores them as they are. Used by the loader (model/gptq.py) and the GPU kernels.
"""

from __future__ import annotations

import torch


def unpack_rows(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """int32 [rows * bits / 32, N] -> the codes [rows, N] (int32), row k from word k // per."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    codes = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
    return codes.reshape(-1, packed.shape[1])[:rows]


def unpack_columns(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """int32 [G, columns * bits / 32] -> the codes [G, columns] (int32)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    codes = (packed.unsqueeze(2) >> shifts.view(1, 1, -1)) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0], -1)[:, :columns]


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `unpack_rows`: codes [K, N] (K a multiple of 32 / bits) -> int32."""
    per = 32 // bits
    grouped = codes.to(torch.int64).view(-1, per, codes.shape[1])
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device).view(1, -1, 1)
    return _wrap_int32((grouped << shifts).sum(dim=1))  # [K / per, N]


def shift_zero_fields(qzeros: torch.Tensor, bits: int, by: int) -> torch.Tensor:
    """Packed zero points with `by` (1 or -1) added to every field, word-wide (carries cross
    fields): the v1 format's minus one as gptqmodel writes it (v2 -> v1), and its exact inverse."""
    ones = sum(1 << (bits * j) for j in range(32 // bits))
    return _wrap_int32(qzeros.to(torch.int64) + by * ones)


def _wrap_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values -> int32 with the same low 32 bits (two's complement)."""
    low = words & 0xFFFFFFFF
    return (low - ((low >> 31) << 32)).to(torch.int32)


def pack_columns(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `unpack_columns`: codes [G, N] (N a multiple of 32 / bits) -> int32."""
    return pack_rows(codes.t().contiguous(), bits).t().contiguous()


def dequantize(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """scale[g] * (code - zero[g]) for every input row k of group g = g_idx[k]: [K, N] float32.

    Exact in float32 for fp16 scales (11 significant bits times a code of at most 8)."""
    groups = g_idx.long()
    return scales.float()[groups] * (codes.float() - zeros.float()[groups])
