"""The 4-bit weights' codes, read and rewritten at load for the kernels of int4_linear.py.

Codes are [N, K] uint8 (0..15), one byte a weight, inputs in the order the kernels read them
(act-order's, group by group). They come from GPTQ's int32 words as loaded (`gptq_codes`) or back
from torch's CPU int4pack (`int4pack_codes`, for a module that has packed itself), and go into
int4_matmul.c's layout (`repack_codes`) or bf16 weights (`dequantize_codes`). The C helpers do the
heavy passes (1 ns a weight; torch's element-wise passes took 16 s of a 1.7B model's start), torch
where no native kernel builds. Buffers are reused across layers: on VMs, first-touched pages cost
seconds a GB.
"""

from __future__ import annotations

import functools
import logging

import torch

from predictor.engine.runners import internals
from predictor.engine.runners.native import bindings as native

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def _int4pack_positions(n: int, k: int) -> torch.Tensor:
    """Where torch's CPU int4pack layout puts each code: nibble i (low nibble of byte i // 2
    first) holds code [n][k] number positions[i]. Read off torch's own packing of the codes'
    indices, 4 bits at a time, so it follows whatever layout this torch version uses."""
    index = torch.arange(n * k, dtype=torch.int64)
    positions = torch.zeros(n * k, dtype=torch.int64)
    for shift in range(0, max(1, (n * k - 1).bit_length()), 4):
        digits = ((index >> shift) & 15).to(torch.int32).view(n, k)
        packed = internals.convert_to_int4pack(digits)
        positions |= _nibbles(packed).long() << shift
    return positions


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(-1)


# torch's CPU int4pack (2.13) stores rows in blocks (64 where torch runs AVX-512, 32 with AVX2):
# per block, for each k, byte d holds row d's code in its low nibble and row d + block / 2's in
# its high one
INT4PACK_BLOCKS = (64, 32, 16)


@functools.lru_cache(maxsize=1)
def _int4pack_block() -> int | None:
    """The block size of this torch's int4pack layout, which `int4pack_codes` reads with a
    permute: found once against the position table of a small probe (None: another layout)."""
    n, k = 2 * max(INT4PACK_BLOCKS), 128
    positions = _int4pack_positions(n, k)
    for block in INT4PACK_BLOCKS:
        order = torch.arange(n * k).view(n // block, 2, block // 2, k).permute(0, 3, 2, 1)
        if torch.equal(order.reshape(-1), positions):
            return block
    logger.warning(
        "torch's int4pack layout is not one int4_linear.py knows: codes are read back through "
        "a position table (a slower start-up, the same kernels)"
    )
    return None


def int4pack_codes(qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The codes [n, k] (uint8, 0..15) of a torch CPU int4pack weight: a permute of its nibbles
    (the layout known), else a scatter through `_int4pack_positions` (16M int64 indices at
    1.7B shapes: seconds a shape)."""
    block = _int4pack_block()
    if block is not None and n % block == 0:
        nibbles = _nibbles(qweight).view(n // block, k, block // 2, 2)
        return nibbles.permute(0, 3, 2, 1).reshape(n, k)
    codes = torch.empty(n * k, dtype=torch.uint8)
    codes[_int4pack_positions(n, k)] = _nibbles(qweight)
    return codes.view(n, k)


def release_repack_tables() -> None:
    """Free the cached int4pack position tables and the expansion's scratch buffer (the runner
    calls it once its layers are built)."""
    _int4pack_positions.cache_clear()
    _SCRATCH.clear()
    _FREE.clear()


def repack_codes(
    compiled: native.Int4Kernel,
    codes: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    n = scales_and_zeros.shape[1]
    codes = codes.contiguous()
    scales = scales_and_zeros[..., 0].to(torch.bfloat16).contiguous()  # [groups, n]
    zeros = scales_and_zeros[..., 1].to(torch.bfloat16).contiguous()
    out = torch.empty(native.Int4Kernel.packed_bytes(n, in_features, group_size), dtype=torch.uint8)
    compiled.repack(
        codes.data_ptr(),
        scales.data_ptr(),
        zeros.data_ptr(),
        n,
        in_features,
        group_size,
        out.data_ptr(),
    )
    return out


def gptq_codes(part: internals.AtenPacked, out: torch.Tensor | None = None) -> torch.Tensor:
    """The codes [N, K] (uint8) of GPTQ's words as loaded, inputs in the part's order (into
    `out`, contiguous, where given; words already in that order where the part says so)."""
    n, k = part.out_features, part.in_features
    as_stored = part.ordered or torch.equal(part.order, torch.arange(k))
    order = None if as_stored else part.order.long().contiguous()
    codes = torch.empty((n, k), dtype=torch.uint8) if out is None else out
    compiled = load_helpers()
    if compiled is not None:
        qweight = part.qweight.contiguous()
        compiled.unpack(
            qweight.data_ptr(), k, n, None if order is None else order.data_ptr(), codes.data_ptr()
        )
        return codes
    shifts = torch.arange(0, 32, 4, dtype=torch.int32).view(1, 8, 1)
    unpacked = ((part.qweight.unsqueeze(1) >> shifts) & 15).reshape(k, n).to(torch.uint8)
    if order is not None:
        unpacked = unpacked.index_select(0, order)
    return codes.copy_(unpacked.t())


# Buffers of codes that layers are done with (`give_back`), reused by the next ones: a fresh
# one a layer faulted in 1.6 GB of pages at 1.7B shapes, seconds of kernel time on VMs; freed by
# `release_repack_tables`.
_FREE: list[torch.Tensor] = []


def give_back(codes: torch.Tensor) -> None:
    """A layer is done with these codes: the next layer's are unpacked into them."""
    _FREE.append(codes)


def codes_buffer(size: int) -> torch.Tensor:
    """`size` bytes (uint8): the smallest free buffer that holds them, else a new one."""
    fits = [i for i, t in enumerate(_FREE) if t.numel() >= size]
    if not fits:
        return torch.empty(size, dtype=torch.uint8)
    best = _FREE.pop(min(fits, key=lambda i: _FREE[i].numel()))
    return best.view(-1)[:size]


def load_helpers() -> native.Int4Kernel | None:
    """int4_matmul.c's load-time helpers (unpack, dequantize: seconds a model faster than
    torch's element-wise passes), or None where no native kernel builds (torch's then)."""
    isas = native.usable_isas()
    if not isas:
        return None
    try:
        return native.int4_matmul(isas[0])
    except native.NativeUnavailable as error:
        note_once(f"weights are unpacked by torch at load (slower): {error}")
        return None


DEQUANTIZE_ROWS = 512  # about 1 ms of the C call at K 2048
_SCRATCH: list[torch.Tensor] = []  # the bf16 expansion's buffer while kernels are built


def scratch(shape: tuple[int, int, int]) -> torch.Tensor:
    """A bf16 [N, K] buffer reused by every layer's expansion before oneDNN copies it: a fresh
    one a layer faulted in 3.4 GB of pages at 1.7B shapes, seconds of kernel time on VMs
    (`release_repack_tables` lets it go)."""
    n, k, _ = shape
    if not _SCRATCH or _SCRATCH[0].numel() < n * k:
        _SCRATCH[:] = [torch.empty(n * k, dtype=torch.bfloat16)]
    return _SCRATCH[0][: n * k].view(n, k)


def dequantize_codes(
    codes: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    n, k = codes.shape
    compiled = load_helpers()
    if compiled is not None:
        codes = codes.contiguous()
        scales = scales_and_zeros[..., 0].to(torch.bfloat16).contiguous()  # [groups, n]
        zeros = scales_and_zeros[..., 1].to(torch.bfloat16).contiguous()
        out = torch.empty((n, k), dtype=torch.bfloat16) if out is None else out
        # DEQUANTIZE_ROWS at a time: the call holds the GIL (a PyDLL), and the runner may
        # expand layers on a thread of its own while the step thread serves
        for low in range(0, n, DEQUANTIZE_ROWS):
            rows = min(DEQUANTIZE_ROWS, n - low)
            compiled.dequantize(
                codes[low].data_ptr(),
                scales[:, low:].data_ptr(),
                zeros[:, low:].data_ptr(),
                rows,
                k,
                group_size,
                n,
                out[low].data_ptr(),
            )
        return out
    scales = scales_and_zeros[..., 0].float().t().unsqueeze(-1)  # [N, groups, 1]
    zeros = scales_and_zeros[..., 1].float().t().unsqueeze(-1)
    weight = codes.reshape(n, k // group_size, group_size).float()  # each group broadcast
    return weight.sub_(8).mul_(scales).add_(zeros).view(n, k).to(torch.bfloat16)


@functools.cache
def note_once(message: str) -> None:
    """Log a fallback to a slower path once per process, with its reason."""
    logger.info(message)
