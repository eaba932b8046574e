"""LoRA adapters in the forward pass: rows of different adapters (and of the base model) in one
batch, each projection's low-rank products computed per adapter over that adapter's tokens.

Per resident adapter (a slot, 1..; 0 is the base model), per layer and projection group (the
runner's fused qkv, o, gate_up and down), the group's factors stacked: A [sum of ranks, in] and
B [group's out, sum of ranks], block-diagonal over the group's modules, the scale folded into B.
A step's tokens are grouped by slot once (`Groups`); each group's projection output gets
(x[tokens] @ A^T) @ B^T added at those tokens (Punica's SGMV for a prompt chunk, BGMV for
decode rows, as two plain matmuls a slot: the CPU's torch ops).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# the runner's projection groups and the modules each stacks, in its output's column order
GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# (slot, the flat indexes of its tokens, None: every token of the step)
Groups = list[tuple[int, torch.Tensor | None]]
# an adapter's factors as model/lora.py reads them: (layer, module) -> (A [r, in], B [out, r])
Factors = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def projection_shapes(layer: Any) -> dict[str, tuple[int, int]]:
    """A decoder layer's separate projections (the modules an adapter may target): their
    (in, out) features."""
    shapes = {}
    for owner, names in ((layer.self_attn, GROUPS["qkv"] + GROUPS["o"]),
                         (layer.mlp, GROUPS["gate_up"] + GROUPS["down"])):  # fmt: skip
        for name in names:
            module = getattr(owner, name, None)
            if module is not None:
                shapes[name] = (int(module.in_features), int(module.out_features))
    return shapes


def group_tokens(slots: Sequence[int], device: torch.device) -> Groups:
    """Each adapter slot of a step's tokens (one per token; 0: the base model, no delta)."""
    present = sorted(set(slots) - {0})
    if len(present) == 1 and len(set(slots)) == 1:
        return [(present[0], None)]
    return [
        (slot, torch.tensor([i for i, s in enumerate(slots) if s == slot], device=device))
        for slot in present
    ]


class LoraWeights:
    """The resident adapters' stacked factors, per slot."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, int]],
        layers: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shapes = shapes  # module -> (in, out) features
        self.layers = layers  # the model's decoder layers
        self.dtype = dtype
        self.device = device
        self._slots: dict[int, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}

    def __contains__(self, slot: int) -> bool:
        return slot in self._slots

    def add(self, slot: int, factors: Factors, scale: float) -> None:
        stacked = {}
        layers = sorted({layer for layer, _ in factors})
        for layer in layers:
            for group, modules in GROUPS.items():
                parts = [(m, factors.get((layer, m))) for m in modules]
                if all(pair is None for _, pair in parts):
                    continue
                a_rows, width = [], 0
                for _, pair in parts:
                    if pair is not None:
                        width += pair[0].shape[0]
                b = torch.zeros(sum(self.shapes[m][1] for m in modules), width)
                row = column = 0
                for module, pair in parts:
                    out = self.shapes[module][1]
                    if pair is not None:
                        a, b_part = pair
                        a_rows.append(a)
                        b[row : row + out, column : column + a.shape[0]] = b_part * scale
                        column += a.shape[0]
                    row += out
                stacked[(layer, group)] = (
                    torch.cat(a_rows).to(self.device, self.dtype).contiguous(),
                    b.to(self.device, self.dtype).contiguous(),
                )
        self._slots[slot] = stacked

    def remove(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def apply(
        self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor, groups: Groups
    ) -> torch.Tensor:
        """`out` (the group's projection of `x`, [N, group out]) plus each adapter's delta at
        its tokens."""
        for slot, tokens in groups:
            stacked = self._slots.get(slot, {}).get((layer, group))
            if stacked is None:
                continue
            a, b = stacked
            if tokens is None:
                out = out + (x @ a.T) @ b.T
            else:
                delta = (x.index_select(0, tokens) @ a.T) @ b.T
                out = out.index_add(0, tokens, delta)
        return out
