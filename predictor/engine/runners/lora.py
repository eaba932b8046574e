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
from dataclasses import dataclass
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


# the native kernel's factors of an adapter: per (layer, group), the group's A^T [in, sum of
# its modules' r'] (module order); per (layer, module), B^T [r', out] (bf16, r' a multiple of 16)
KernelFactors = tuple[dict[tuple[int, str], torch.Tensor], dict[tuple[int, str], torch.Tensor]]


def kernel_factors(factors: Factors, scale: float, device: torch.device) -> KernelFactors:
    """An adapter's factors as the native kernel reads them: bf16, the scale folded into B, the
    rank zero-padded to r', a multiple of 16 (its vectors), and a group's A^T side by side (its
    modules share their input). A module's layers are converted together: a few ops a module,
    as loading at run time shares the GIL with the step loop."""
    a_t: dict[tuple[int, str], torch.Tensor] = {}
    b_t: dict[tuple[int, str], torch.Tensor] = {}
    for module in sorted({m for _, m in factors}):
        keys = sorted(key for key in factors if key[1] == module)
        rank, features_in = factors[keys[0]][0].shape
        features_out = factors[keys[0]][1].shape[0]
        padded = -(-rank // 16) * 16
        a_all = torch.zeros(len(keys), features_in, padded, dtype=torch.bfloat16, device=device)
        b_all = torch.zeros(len(keys), padded, features_out, dtype=torch.bfloat16, device=device)
        a_all[:, :, :rank] = torch.stack([factors[key][0] for key in keys]).transpose(1, 2)
        b_all[:, :rank] = torch.stack([factors[key][1] for key in keys]).transpose(1, 2) * scale
        for i, key in enumerate(keys):
            a_t[key], b_t[key] = a_all[i], b_all[i]  # contiguous views of the module's buffers
    groups = {}
    for layer in sorted({layer for layer, _ in factors}):
        for group, modules in GROUPS.items():
            parts = [a_t[(layer, m)] for m in modules if (layer, m) in a_t]
            if parts:
                groups[(layer, group)] = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    return groups, b_t


MODULES = 3  # table entries per adapter and group: the most modules a group stacks (q, k, v)


@dataclass(frozen=True)
class Tables:
    """Per (layer, group), for the native kernel: int64 [adapters * MODULES] of the addresses of
    each adapter's group A^T (at its first module; 0 at the others) and modules' B^T, the
    modules' padded ranks (0: not adapted), first columns in the group's output and widths; an
    adapter's entries at its row (`index`) * MODULES. `addresses`: the five tables' own
    addresses per (layer, group), as the kernel takes them (a step makes 4 calls a layer, each
    a few microseconds: nothing is looked up twice)."""

    index: dict[int, int]  # slot -> its row in every table
    by_group: dict[tuple[int, str], tuple[torch.Tensor, ...]]
    addresses: dict[tuple[int, str], tuple[int, ...]]


@dataclass(frozen=True)
class Step:
    """A step's tokens as the adapters see them: grouped by slot (the torch path), and each
    token's row in the native kernel's tables (-1: the base model)."""

    groups: Groups
    which: torch.Tensor
    order: torch.Tensor  # the tokens, grouped by adapter (each adapter's factors read once)
    tables: Tables
    rows: tuple[int, int]  # which's and order's addresses


class LoraWeights:
    """The resident adapters' factors, per slot: as read (fp32), and in the native kernel's
    bf16 layout (9.8 MB a step reads for a rank-16 adapter on every projection of the default
    model); fp32 stacks per group for torch's matmuls are made from the first where a step
    needs them (a model not on the native path, and the check of the kernel against them)."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, int]],
        layers: int,
        device: torch.device,
    ) -> None:
        self.shapes = shapes  # module -> (in, out) features
        self.layers = layers  # the model's decoder layers
        self.device = device
        self._factors: dict[int, tuple[Factors, float]] = {}  # per slot, as read, and its scale
        # per slot, made on first use: fp32 stacks per (layer, group) for torch's path
        self._slots: dict[int, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}
        # per slot, the native kernel's bf16 factors (a quarter of the fp32 stacks' bytes)
        self._modules: dict[int, KernelFactors] = {}
        self._tables = Tables({}, {}, {})  # replaced whole when adapters come and go
        # layer_ops.c's lora_add (a bf16 model on the native path), else torch's matmuls
        self.kernel: Any = None

    def add(self, slot: int, factors: Factors, scale: float) -> None:
        """Make an adapter resident. Few torch ops (a module's layers at once): loading at
        run time shares the GIL with the step loop, whose every op waits for it."""
        self._factors[slot] = (factors, scale)
        self._modules[slot] = kernel_factors(factors, scale, self.device)
        self._tables = self._build_tables()

    def _stacked(self, slot: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """The slot's fp32 stacks per (layer, group), made on first use (torch's path only)."""
        stacked = self._slots.get(slot)
        if stacked is not None or slot not in self._factors:
            return stacked or {}
        factors, scale = self._factors[slot]
        stacked = {}
        for layer in sorted({layer for layer, _ in factors}):
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
                # transposed for x @ A^T @ B^T, in fp32: tiny matmuls in bf16 cost ~10x
                # (oneDNN's per-call overhead), and the products are summed in fp32
                stacked[(layer, group)] = (
                    torch.cat(a_rows).T.contiguous().to(self.device),
                    b.T.contiguous().to(self.device),
                )
        self._slots[slot] = stacked
        return stacked

    def remove(self, slot: int) -> None:
        self._slots.pop(slot, None)
        self._factors.pop(slot, None)
        self._modules.pop(slot, None)
        self._tables = self._build_tables()

    def _build_tables(self) -> Tables:
        resident = dict(self._modules)
        index = {slot: i for i, slot in enumerate(resident)}
        by_group: dict[tuple[int, str], tuple[torch.Tensor, ...]] = {}
        for layer in range(self.layers):
            for group, modules in GROUPS.items():
                entries = []  # (A^T, B^T, column, width) per adapter and module slot
                for slot in index:
                    a_groups, b_modules = resident[slot]
                    a_t = a_groups.get((layer, group))
                    column = 0
                    for m in range(MODULES):
                        module = modules[m] if m < len(modules) else None
                        b_t = b_modules.get((layer, module)) if module else None
                        width = self.shapes[module][1] if module else 0
                        entries.append((a_t if m == 0 else None, b_t, column, width))
                        column += width
                by_group[(layer, group)] = (
                    torch.tensor([a.data_ptr() if a is not None else 0 for a, _, _, _ in entries]),
                    torch.tensor([b.data_ptr() if b is not None else 0 for _, b, _, _ in entries]),
                    torch.tensor([b.shape[0] if b is not None else 0 for _, b, _, _ in entries]),
                    torch.tensor([c for _, _, c, _ in entries]),
                    torch.tensor([w for _, _, _, w in entries]),
                )
        addresses = {key: tuple(t.data_ptr() for t in tables)
                     for key, tables in by_group.items()}  # fmt: skip
        return Tables(index, by_group, addresses)

    def step(self, slots: Sequence[int]) -> Step | None:
        """A step's view of its tokens' slots (one per token); None: no adapter in it."""
        if not any(slots):
            return None
        tables = self._tables
        which = torch.tensor([tables.index.get(s, -1) if s else -1 for s in slots])
        order = torch.argsort(which, stable=True)
        return Step(group_tokens(slots, self.device), which, order, tables,
                    (which.data_ptr(), order.data_ptr()))  # fmt: skip

    def apply(
        self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor, step: Step
    ) -> torch.Tensor:
        """`out` (the group's projection of `x`, [N, group out], a tensor of this step's own:
        changed in place) plus each adapter's delta at its tokens."""
        if self.kernel is not None and x.dtype == out.dtype == torch.bfloat16:
            # one call for every row, each with its own adapter (BGMV)
            addresses = step.tables.addresses[(layer, group)]
            self.kernel.lora_add(x.contiguous(), step.rows, addresses, MODULES, out)
            return out
        for slot, tokens in step.groups:
            stacked = self._stacked(slot).get((layer, group))
            if stacked is None:
                continue
            a_t, b_t = stacked
            rows = x if tokens is None else x.index_select(0, tokens)
            delta = ((rows.float() @ a_t) @ b_t).to(out.dtype)
            if tokens is None:
                out.add_(delta)
            else:
                out.index_add_(0, tokens, delta)
        return out
