"""The one place the runners touch private torch ops (the underscore ones of `torch.ops`).

Each is an op torch's own code paths use (gptqmodel's TorchAtenLinear calls the int4 ones,
inductor the oneDNN ones) with no public equivalent in torch 2.13; each has a contract test in
tests/engine/runners/test_internals.py that calls it as production does, so a torch upgrade that
changes one fails there, naming it.

1. INT4PACK_MM: `aten._weight_int4pack_mm_for_cpu(x [M, K] bf16, packed, group, scales_and_zeros)`
   -> [M, N]: the int4 matmul of TorchAtenLinear's packed weights.
2. INT4PACK_CONVERT: `aten._convert_weight_to_int4pack_for_cpu(codes [N, K] int32, 1)`: torch's
   packing, read back to learn its layout (int4_linear's repack for the native kernel).
3. ONEDNN_PREPACK: `mkldnn._reorder_linear_weight(w [N, K] bf16, batch)` and
   `mkldnn._linear_pointwise(x, prepacked, None, "none", [], "")`: oneDNN's prepacked linear.
4. INT4PACK_CUDA: `aten._convert_weight_to_int4pack(codes [N, K / 2] uint8, inner_k_tiles)`
   (two codes a byte, the even input in the high nibble) and `aten._weight_int4pack_mm(x [M, K]
   bf16, packed, group, scales_and_zeros [K / group, N, 2] bf16)` -> [M, N]: tinygemm, the GPU
   runner's int4 kernel (cuda/linear.py); (code - 8) * scale + zero. The GPU machine runs
   another torch (2.11) than the CPU pin (2.13): the contract test runs there too.
"""

from __future__ import annotations

import torch

ITEMS = ("INT4PACK_MM", "INT4PACK_CONVERT", "ONEDNN_PREPACK", "INT4PACK_CUDA")


def int4pack_mm(
    x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, packed, group_size, scales_and_zeros
    )
    return out


def convert_to_int4pack(codes: torch.Tensor) -> torch.Tensor:
    packed: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return packed


def onednn_prepack_available() -> bool:
    mkldnn = torch.ops.mkldnn
    return hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")


def onednn_reorder(weight: torch.Tensor, batch: int = 16) -> torch.Tensor:
    prepacked: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, batch)
    return prepacked


def onednn_linear(x: torch.Tensor, prepacked: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, prepacked, None, "none", [], "")
    return out


def convert_to_int4pack_cuda(packed: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    out: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles)
    return out


def int4pack_mm_cuda(
    x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    out: torch.Tensor = torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)
    return out
