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
5. GPTQMODEL_ATEN: gptqmodel 7.6's `TorchAtenLinear` (the CPU kernel transformers loads a GPTQ
   checkpoint with). As loaded (`linear_mode` None): GPTQ's own tensors, `qweight` [K / 8, N]
   int32, `qzeros` [groups, N / 8] int32 holding the zero codes themselves (`qzero_format()` 2:
   gptqmodel converts v1 checkpoints' code - 1 at load), `scales` [groups, N], `g_idx` [K],
   `bits`. Once packed by its `transform("cpu")` (what its first forward does; `linear_mode`
   "inference" after): `qweight` torch's int4pack [N, K / 2] uint8, `scales_and_zeros`
   [groups, N, 2] bf16, `ret_idx` [K] (act-order's input order: rows stored group by group).
   Both: `group_size`, `in_features`, `out_features`, `bias`, `adapter`. The runner reads them
   through `aten_packed` only (as loaded where it can: packing a 1.7B model took 12 s of its
   start-up); anything else is a reason it gives, and logs. The server reads a checkpoint it
   serves without gptqmodel (model/gptq.py's `GPTQLinear`: `qweight` [K / 8, N] int32 with
   act-order's rows already sorted by group, `zeros` [groups, N] the zero codes, `scales`,
   `perm` [K] or None): `aten_packed` reads that too, as the same AtenPacked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

ITEMS = ("INT4PACK_MM", "INT4PACK_CONVERT", "ONEDNN_PREPACK", "INT4PACK_CUDA", "GPTQMODEL_ATEN")
ATEN_LINEAR = "TorchAtenLinear"
GPTQ_LINEAR = "GPTQLinear"  # predictor/model/gptq.py's (the engine does not import the model)


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


@dataclass(frozen=True)
class AtenPacked:
    """What the runner reads of a TorchAtenLinear, as loaded or packed (`int4pack`)."""

    qweight: torch.Tensor  # GPTQ's [K / 8, N] int32, or (int4pack) torch's [N, K / 2] uint8
    int4pack: bool
    scales_and_zeros: torch.Tensor  # [groups, N, 2] bf16 (torch's convention: see int4_linear)
    order: torch.Tensor  # [K] int: input k is read at order[k] (act-order; else the identity)
    bias: torch.Tensor | None
    group_size: int
    in_features: int
    out_features: int
    ordered: bool = False  # qweight's rows are already in `order` (GPTQLinear's act-order)


def aten_packed(module: Any, bias: bool = False) -> AtenPacked | str:
    """The module's 4-bit tensors (GPTQ's as loaded; else packed now, as its first forward
    would), or why the runner's fused kernels cannot serve it: another kernel class, training
    mode, an adapter, a bias (unless `bias`), not packable here."""
    kind = type(module).__name__
    if kind not in (ATEN_LINEAR, GPTQ_LINEAR):
        return f"its Linears are {kind}, not gptqmodel's {ATEN_LINEAR}"
    if module.training or getattr(module, "adapter", None):
        return "a Linear is in training mode or carries an adapter"
    if module.bias is not None and not bias:
        return "an output projection has a bias"
    if kind == GPTQ_LINEAR:
        return _read(module)
    on_cpu = module.qweight.device.type == "cpu"
    if getattr(module, "linear_mode", None) is None and on_cpu and _as_loaded(module):
        return _loaded(module)
    if getattr(module, "linear_mode", None) is None and on_cpu:
        module.transform("cpu")
        module.linear_mode = "inference"
    if module.linear_mode != "inference":
        return f"{ATEN_LINEAR} is in {module.linear_mode!r} mode, not packed for the CPU"
    return AtenPacked(
        qweight=module.qweight,
        int4pack=True,
        scales_and_zeros=module.scales_and_zeros,
        order=module.ret_idx,
        bias=module.bias,
        group_size=int(module.group_size),
        in_features=int(module.in_features),
        out_features=int(module.out_features),
    )


def _read(module: Any) -> AtenPacked | str:
    """A GPTQLinear's tensors: zero codes unpacked already, act-order's rows already sorted."""
    n, k = int(module.out_features), int(module.in_features)
    shape = tuple(module.qweight.shape)
    if int(module.bits) != 4 or module.qweight.dtype != torch.int32 or shape != (k // 8, n):
        return f"a {GPTQ_LINEAR} of {module.bits} bits or packed as {shape}, not 4-bit GPTQ's"
    if module.qweight.device.type != "cpu":
        return f"a {GPTQ_LINEAR} on {module.qweight.device}, not the CPU"
    scales = module.scales.to(torch.bfloat16)
    zeros = (8 - module.zeros.to(torch.bfloat16)) * scales
    ordered = module.perm is not None
    return AtenPacked(
        qweight=module.qweight,
        int4pack=False,
        scales_and_zeros=torch.stack((scales, zeros), dim=2).contiguous(),
        order=module.perm if ordered else torch.arange(k),
        bias=module.bias,
        group_size=int(module.group_size),
        in_features=k,
        out_features=n,
        ordered=ordered,
    )


def _as_loaded(module: Any) -> bool:
    """GPTQ's 4-bit tensors, zero codes as they are (v2), in the shapes `_loaded` reads."""
    n, k = int(module.out_features), int(module.in_features)
    return (
        int(module.bits) == 4
        and module.qzero_format() == 2
        and module.qweight.dtype == torch.int32
        and tuple(module.qweight.shape) == (k // 8, n)
        and module.qzeros.dtype == torch.int32
        and module.qzeros.shape[1] * 8 == n
        and k % 8 == 0
    )


def _loaded(module: Any) -> AtenPacked:
    """GPTQ's tensors as loaded, with the scales and zero offsets `transform("cpu")` computes:
    bf16 scales, zero = (8 - zero code) * scale in bf16 (torch's int4 op: scale * (code - 8) +
    zero), and act-order's input order (inputs sorted by group, stably: its `ret_idx`)."""
    scales = module.scales.to(torch.bfloat16)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    zero_codes = ((module.qzeros.unsqueeze(2) >> shifts) & 15).reshape(scales.shape)
    zeros = (8 - zero_codes.to(torch.bfloat16)) * scales
    return AtenPacked(
        qweight=module.qweight,
        int4pack=False,
        scales_and_zeros=torch.stack((scales, zeros), dim=2).contiguous(),
        order=torch.argsort(module.g_idx.to(torch.int64), stable=True),
        bias=module.bias,
        group_size=int(module.group_size),
        in_features=int(module.in_features),
        out_features=int(module.out_features),
    )
