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
DENSE_MIN_ROWS = 6


class Int4Linear(torch.nn.Module):
    """The output columns of `parts` side by side, as one matmul.

    Where torch has oneDNN's prepacked linear (`mkldnn._linear_pointwise`), the int4 weights are
    also expanded once, exactly (the int4 op applied to an identity matrix), into bf16 and
    prepacked, and steps of DENSE_MIN_ROWS tokens or more use them: measured on this CPU at 16
    rows, 273 us against 664 us for the int4 op (gate/up of SmolLM2-135M). With fewer rows a
    step reads every layer's weights once and little else, and the int4 op moves a quarter of
    the bytes. Whole SmolLM2 steps, prepacked against int4, 1 thread: 3 rows 31.7 / 25.0 ms,
    4 rows 32.7 / 28.0, 6 rows 37.2 / 37.8, 8 rows 38.7 / 41.7, 12 rows 45.1 / 55.4; so from 6
    rows on. (A layer's weights alone stay in cache; a whole step's bf16 weights, 212 MB, do
    not, and at a few rows the step is bound by reading them.) The prepacked copy costs
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
        if x.dim() != 2 or x.dtype != torch.bfloat16:  # the runner's own calls are [N, K] bf16
            flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
            return self(flat).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if self.prepacked is not None and x.shape[0] >= DENSE_MIN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.prepacked, None, "none", [], "")
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.qweight, self.group_size, self.scales_and_zeros
        )

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(out.split(self.splits, dim=-1))


def _prepack(
    qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, in_features: int
) -> torch.Tensor | None:
    """The int4 weights as a oneDNN-prepacked bf16 matrix, or None where torch lacks it."""
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return None
    try:
        eye = torch.eye(in_features, dtype=torch.bfloat16, device=qweight.device)
        # [K, N]: row k is what input k contributes, i.e. the dequantized weights, exactly
        dense = torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, qweight, group_size, scales_and_zeros
        )
    except Exception:  # this build cannot: the int4 op serves
        return None
    return _reorder(dense.t())


def dense_linear(module: Any) -> Any:
    """A bias-free bf16 `nn.Linear` on the CPU (lm_head) as a oneDNN-prepacked matmul, or the
    module itself. Measured for SmolLM2's tied [49152, 576] lm_head, 1 thread: 3.9 ms against
    6.2 ms for the module at 1 row, 6.6 against 10.1 at 16. The copy costs the weight's bytes
    once more (57 MB); fp32 weights keep the module, whose numbers the exactness tests hold."""
    weight = getattr(module, "weight", None)
    if (
        not isinstance(module, torch.nn.Linear)
        or module.bias is not None
        or weight is None
        or weight.dtype != torch.bfloat16
        or weight.device.type != "cpu"
    ):
        return module
    prepacked = _reorder(weight.detach())
    if prepacked is None:
        return module
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, prepacked, None, "none", [], "")


def _reorder(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 [N, K] weight prepacked for oneDNN's linear, or None where this torch lacks it."""
    mkldnn = torch.ops.mkldnn
    if not (hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")):
        return None
    try:
        prepacked: torch.Tensor = mkldnn._reorder_linear_weight(weight.contiguous(), 16)
        probe = torch.ones((1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
        mkldnn._linear_pointwise(probe, prepacked, None, "none", [], "")
        return prepacked
    except Exception:  # this build cannot: the caller keeps its own matmul
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
