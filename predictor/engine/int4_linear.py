"""The runner's CPU linear layers, built from gptqmodel's TorchAtenLinear, projections fused.

TorchAtenLinear (gptqmodel's CPU kernel, torch's `_weight_int4pack_mm_for_cpu`) reorders every
input by `ret_idx` before the matmul, even when the checkpoint has no act-order and the order is
the identity (210 gathers a step for SmolLM2: measured 6-8 ms of a 16-row step). And q, k, v
(and gate, up) read the same input in three (two) calls. `Int4Linear` calls the op directly,
with the output columns of several such layers side by side, so a layer's q, k and v are one
call, and gate and up another: 7 kernel calls a layer become 4.

Only layers whose reordering is the identity, with no bias and no adapter, are fused. Steps of
several rows run the same weights expanded to bf16 and prepacked for oneDNN (see Int4Linear);
the numbers differ from the int4 op's by bf16 rounding only. Only the runner uses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# steps with at least this many tokens run the prepacked bf16 weights, fewer the int4 op
DENSE_MIN_ROWS = 4


class Int4Linear(torch.nn.Module):
    """The output columns of `parts` side by side, as one matmul.

    Where torch has oneDNN's prepacked linear (`mkldnn._linear_pointwise`), the int4 weights are
    also expanded once, exactly (the int4 op applied to an identity matrix), into bf16 and
    prepacked, and steps of DENSE_MIN_ROWS tokens or more use them: measured on this CPU at 16
    rows, 273 us against 664 us for the int4 op (gate/up of SmolLM2-135M). With fewer rows a
    step reads every layer's weights once and little else, and the int4 op moves a quarter of
    the bytes: a 1-row step took 37 ms prepacked against 25 ms int4. The prepacked copy costs
    4x the fused layers' int4 bytes (about 200 MB for SmolLM2-135M).
    """

    def __init__(self, parts: Sequence[Any]) -> None:
        super().__init__()
        first = parts[0]
        self.group_size = int(first.group_size)
        self.in_features = int(first.in_features)
        self.splits = [int(p.out_features) for p in parts]
        self.out_features = sum(self.splits)
        # packed weights [N, K / 2] and scales-and-zeros [groups, N, 2]: N side by side
        qweight = torch.cat([p.qweight for p in parts], dim=0)
        scales_and_zeros = torch.cat([p.scales_and_zeros for p in parts], dim=1)
        self.prepacked: torch.Tensor | None = _prepack(
            qweight, scales_and_zeros, self.group_size, self.in_features
        )
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.out_features)
        flat = x.reshape(-1, x.shape[-1])
        if flat.dtype != torch.bfloat16:
            flat = flat.to(torch.bfloat16)
        if self.prepacked is not None and flat.shape[0] >= DENSE_MIN_ROWS:
            out = torch.ops.mkldnn._linear_pointwise(flat, self.prepacked, None, "none", [], "")
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, self.qweight, self.group_size, self.scales_and_zeros
            )
        return out.to(x.dtype).reshape(shape)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(out.split(self.splits, dim=-1))


def _prepack(
    qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, in_features: int
) -> torch.Tensor | None:
    """The int4 weights as a oneDNN-prepacked bf16 matrix, or None where torch lacks it."""
    mkldnn = torch.ops.mkldnn
    if not (hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")):
        return None
    try:
        eye = torch.eye(in_features, dtype=torch.bfloat16, device=qweight.device)
        # [K, N]: row k is what input k contributes, i.e. the dequantized weights, exactly
        dense = torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, qweight, group_size, scales_and_zeros
        )
        prepacked: torch.Tensor = mkldnn._reorder_linear_weight(dense.t().contiguous(), 16)
        probe = torch.ones((1, in_features), dtype=torch.bfloat16, device=qweight.device)
        mkldnn._linear_pointwise(probe, prepacked, None, "none", [], "")
        return prepacked
    except Exception:  # this build cannot: the int4 op serves
        return None


def _packed(module: Any) -> bool:
    """A TorchAtenLinear packed for the CPU (packing it now, as its first forward would), in
    identity order, with no bias and no adapter."""
    if type(module).__name__ != "TorchAtenLinear" or module.training:
        return False
    if module.bias is not None or getattr(module, "adapter", None):
        return False
    if getattr(module, "linear_mode", None) is None and module.qweight.device.type == "cpu":
        module.transform("cpu")
        module.linear_mode = "inference"
    if module.linear_mode != "inference" or not hasattr(module, "scales_and_zeros"):
        return False
    ret_idx = getattr(module, "ret_idx", None)
    if not isinstance(ret_idx, torch.Tensor):
        return False
    return bool(torch.equal(ret_idx.long().cpu(), torch.arange(ret_idx.numel())))


@dataclass
class FusedLayer:
    """A decoder layer's projections as four calls: qkv, o, gate_up, down."""

    qkv: Int4Linear
    o: Int4Linear
    gate_up: Int4Linear
    down: Int4Linear


def fuse_layer(layer: Any) -> FusedLayer | None:
    """The layer's projections fused, or None when any of them is not a plain packed
    TorchAtenLinear (other kernels, act-order, a GPU): the runner then calls the model's own.

    The model keeps its modules (transformers' own forward still works, e.g. for evaluation);
    the fused copies add the packed weights once more (about 50 MB for SmolLM2-135M)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    gate_up = [mlp.gate_proj, mlp.up_proj]
    try:
        if not all([_packed(m) for m in (*qkv, *gate_up, attn.o_proj, mlp.down_proj)]):
            return None
    except Exception:  # gptqmodel's internals moved: keep its own modules
        return None
    if len({m.group_size for m in qkv}) != 1 or len({m.group_size for m in gate_up}) != 1:
        return None
    return FusedLayer(
        Int4Linear(qkv), Int4Linear([attn.o_proj]), Int4Linear(gate_up), Int4Linear([mlp.down_proj])
    )
