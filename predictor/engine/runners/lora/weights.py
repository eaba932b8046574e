"""LoRA adapters in the forward pass: rows of different adapters (and of the base model) in one
batch, each projection's low-rank products computed per adapter over that adapter's tokens.

Per resident adapter (a slot, 1..; 0 is the base model), per layer and projection group (the
runner's fused qkv, o, gate_up and down), the group's factors stacked: A [sum of ranks, in] and
B [group's out, sum of ranks], block-diagonal over the group's modules, the scale folded into B.
A step's tokens are grouped by slot once (`Groups`); each group's projection output gets
(x[tokens] @ A^T) @ B^T added at those tokens (Punica's SGMV for a prompt chunk, BGMV for
decode rows, as two plain matmuls a slot: the CPU's torch ops).

On the native path (a bf16 model), layer_ops.c's lora_add does it for every row in one call a
projection, in one of two modes (`MODES`): "bf16", the factors in bf16 and the sums in fp32;
"int8" (AVX-512 VNNI), the factors and the activations in int8 (half the bytes a step reads,
a quarter of the instructions). The autotune (lora/tune.py) times both at each
row-count bucket and `plan` picks per step.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from predictor.types import run_to_end

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
    for owner, names in (
        (layer.self_attn, GROUPS["qkv"] + GROUPS["o"]),
        (layer.mlp, GROUPS["gate_up"] + GROUPS["down"]),
    ):
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


Layouts = Generator[None, None, KernelFactors]  # a layout made a module (a slice) at a time


def bf16_layouts(factors: Factors, scale: float, device: torch.device) -> Layouts:
    """An adapter's factors as the native kernel reads them: bf16, the scale folded into B, the
    rank zero-padded to r', a multiple of 16 (its vectors), and a group's A^T side by side (its
    modules share their input). A module's layers are converted together (a few ops), a slice
    each (the step loop runs them between steps: StepLoop.run_chore)."""
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
        yield
    groups = {}
    for layer in sorted({layer for layer, _ in factors}):
        for group, modules in GROUPS.items():
            parts = [a_t[(layer, m)] for m in modules if (layer, m) in a_t]
            if parts:
                groups[(layer, group)] = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    return groups, b_t


def _int8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [..., rows, n] as int8 with one scale per row (max |t| / 127; 1 where zero)."""
    scale = t.abs().amax(-1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(t / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8), scale


def _vnni(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 factors as lora_add's int8 mode reads them: q [layers, columns, n] (a column's n
    values, n a multiple of 4, each column with its scale) as [n / 4][columns][4], then int32
    column sums and fp32 scales, all as bytes: [layers, bytes], a layer's a contiguous row."""
    layers, columns, n = q.shape
    laid = q.reshape(layers, columns, n // 4, 4).transpose(1, 2).contiguous()
    colsum = q.sum(2, dtype=torch.int32)
    return torch.cat(
        [
            laid.view(torch.uint8).flatten(1),
            colsum.view(torch.uint8),
            scale.float().contiguous().view(torch.uint8),
        ],
        1,
    )


def int8_layouts(factors: Factors, scale: float, device: torch.device) -> Layouts:
    """An adapter's factors for lora_add's int8 mode: as `bf16_layouts` (the rank padded to
    r', a group's A^T side by side), in int8 with a scale per rank vector of A and per output
    of B (rows of each as stored: no fp32 transposes), laid out for VNNI (`_vnni`) with A's
    inputs zero-padded to a multiple of 4. A module's layers are converted together, a group's
    A too where its modules adapt the same layers (a few dozen ops an adapter), a slice a
    module and a group."""
    a_q: dict[str, tuple[list[int], torch.Tensor, torch.Tensor]] = {}  # module -> layers, q, s
    b_t: dict[tuple[int, str], torch.Tensor] = {}
    for module in sorted({m for _, m in factors}):
        keys = sorted(key for key in factors if key[1] == module)
        rank, features_in = factors[keys[0]][0].shape
        padded, in4 = -(-rank // 16) * 16, -(-features_in // 4) * 4
        qa, sa = _int8_rows(torch.stack([factors[key][0] for key in keys]).to(device))
        qa = torch.nn.functional.pad(qa, (0, in4 - features_in, 0, padded - rank))
        sa = torch.nn.functional.pad(sa, (0, padded - rank), value=1.0)
        a_q[module] = ([layer for layer, _ in keys], qa, sa)
        qb, sb = _int8_rows(torch.stack([factors[key][1] for key in keys]).to(device) * scale)
        b_bytes = _vnni(torch.nn.functional.pad(qb, (0, padded - rank)), sb)
        for i, key in enumerate(keys):
            b_t[key] = b_bytes[i]
        yield
    groups: dict[tuple[int, str], torch.Tensor] = {}
    for group, modules in GROUPS.items():
        present = [m for m in modules if m in a_q]
        by_pattern: dict[tuple[str, ...], list[int]] = {}  # layers by the modules they adapt
        for layer in sorted({layer for m in present for layer in a_q[m][0]}):
            pattern = tuple(m for m in present if layer in a_q[m][0])
            by_pattern.setdefault(pattern, []).append(layer)
        for pattern, layers in by_pattern.items():
            qs, scales = [], []
            for m in pattern:
                rows = torch.tensor([a_q[m][0].index(layer) for layer in layers])
                qs.append(a_q[m][1].index_select(0, rows))
                scales.append(a_q[m][2].index_select(0, rows))
            laid = _vnni(torch.cat(qs, 1), torch.cat(scales, 1))
            for i, layer in enumerate(layers):
                groups[(layer, group)] = laid[i]
        yield
    return groups, b_t


# lora_add's modes, by its number for each (the factors' layout each reads)
MODES: dict[str, tuple[int, Callable[[Factors, float, torch.device], Layouts]]] = {
    "bf16": (0, bf16_layouts),
    "int8": (1, int8_layouts),
}
MODULES = 3  # table entries per adapter and group: the most modules a group stacks (q, k, v)


@dataclass(frozen=True)
class Tables:
    """For the native kernel, per (layer, group) and mode, five int64 tables of [adapters *
    MODULES] entries: the addresses of each adapter's group A^T (at its first module; 0 at the
    others) and modules' B^T, the modules' padded ranks (0: not adapted), first columns in the
    group's output and widths (an adapter's entries at its row, `index`, * MODULES); then the
    call's own table: [mode, the five tables' addresses, MODULES, the group's input features].
    All in one tensor (`memory`, made in one op); `calls`: per mode (its number), per (layer,
    group), its call table's address (a step makes 4 calls a layer, each a microsecond or two:
    nothing is looked up twice)."""

    index: dict[int, int]  # slot -> its row in every table
    memory: torch.Tensor
    calls: dict[int, dict[tuple[int, str], int]]


@dataclass(frozen=True)
class Step:
    """A step's tokens as the adapters see them: grouped by slot (the torch path), and each
    token's row in the native kernel's tables (-1: the base model)."""

    groups: Groups
    which: torch.Tensor
    order: torch.Tensor  # the tokens, grouped by adapter (each adapter's factors read once)
    tables: Tables
    args: torch.Tensor  # int64 [tokens, which's address, order's address]: the kernel's step
    address: int  # args'
    calls: dict[tuple[int, str], int]  # the call tables of the mode the plan gives its rows


class LoraWeights:
    """The resident adapters' factors, per slot: as read (fp32), and in the native kernel's
    layout for each mode its plan uses (bf16: 9.8 MB a step reads for a rank-16 adapter on every
    projection of the default model; int8: 5 MB); fp32 stacks per group for torch's matmuls are
    made from the first where a step needs them (a model not on the native path, and the check
    of the kernel against them)."""

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
        # per slot, the native kernel's factors per mode number
        self._modules: dict[int, dict[int, KernelFactors]] = {}
        # replaced whole when adapters come and go
        self._tables = Tables({}, torch.zeros(0, dtype=torch.int64), {})
        # layer_ops.c's lora_add (a bf16 model on the native path), else torch's matmuls
        self.kernel: Any = None
        # lora_add's mode per row-count bucket: (fewest rows, mode number), ascending
        self._plan: list[tuple[int, int]] = [(1, MODES["bf16"][0])]

    @property
    def plan(self) -> list[tuple[int, str]]:
        names = {number: name for name, (number, _) in MODES.items()}
        return [(rows, names[mode]) for rows, mode in self._plan]

    @plan.setter
    def plan(self, plan: list[tuple[int, str]]) -> None:
        """Set lora_add's mode per bucket (the autotune's choice); each resident adapter gets
        the layouts the new plan reads (and loses the others)."""
        self._plan = [(rows, MODES[name][0]) for rows, name in plan]
        for slot in self._modules:
            self._modules[slot] = run_to_end(self._making(*self._factors[slot]))
        self._tables = self._build_tables()

    def _making(
        self, factors: Factors, scale: float
    ) -> Generator[None, None, dict[int, KernelFactors]]:
        """The layouts the plan's modes read, per mode number, a slice at a time."""
        used = {mode for _, mode in self._plan}
        layouts = {}
        for number, make in MODES.values():
            if number in used:
                layouts[number] = yield from make(factors, scale, self.device)
        return layouts

    def add(self, slot: int, factors: Factors, scale: float) -> None:
        """Make an adapter resident."""
        run_to_end(self.adding(slot, factors, scale))

    def adding(self, slot: int, factors: Factors, scale: float) -> Generator[None, None, None]:
        """`add`, a slice at a time (a module's layout, then the tables): what the step loop
        runs between steps when an adapter is loaded at run time."""
        layouts = yield from self._making(factors, scale)
        self._factors[slot] = (factors, scale)
        self._modules[slot] = layouts
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
        values: list[int] = []
        calls_at: dict[tuple[int, int, str], int] = {}  # (mode, layer, group) -> its offset
        width = len(index) * MODULES  # entries a table
        for mode in sorted({mode for _, mode in self._plan}):
            for layer in range(self.layers):
                for group, modules in GROUPS.items():
                    first = len(values)
                    values += self._group_tables(resident, index, layer, group, mode)
                    calls_at[(mode, layer, group)] = len(values)
                    features_in = self.shapes[modules[0]][0] if modules[0] in self.shapes else 0
                    # the tables' addresses: their offsets here until `memory` exists
                    values += [mode, *(first + t * width for t in range(5)), MODULES, features_in]
        memory = torch.tensor(values, dtype=torch.int64)
        base = memory.data_ptr()
        at = torch.tensor(
            [offset + 1 + t for offset in calls_at.values() for t in range(5)], dtype=torch.int64
        )
        memory[at] = base + 8 * memory[at]
        calls: dict[int, dict[tuple[int, str], int]] = {}
        for (mode, layer, group), offset in calls_at.items():
            calls.setdefault(mode, {})[(layer, group)] = base + 8 * offset
        return Tables(index, memory, calls)

    def _group_tables(
        self,
        resident: dict[int, dict[int, KernelFactors]],
        index: dict[int, int],
        layer: int,
        group: str,
        mode: int,
    ) -> list[int]:
        """One (layer, group)'s five tables for one mode, one after another (Tables)."""
        modules = GROUPS[group]
        tables: list[list[int]] = [[], [], [], [], []]  # A^T, B^T, rank, column, width
        for slot in index:
            a_groups, b_modules = resident[slot][mode]
            a_t = a_groups.get((layer, group))
            column = 0
            for m in range(MODULES):
                module = modules[m] if m < len(modules) else None
                b_t = b_modules.get((layer, module)) if module else None
                width = self.shapes[module][1] if module else 0
                rank = 0
                if b_t is not None and module:  # the padded rank: its share of the A^T
                    rank = -(-self._factors[slot][0][(layer, module)][0].shape[0] // 16) * 16
                entry = (
                    a_t.data_ptr() if a_t is not None and m == 0 else 0,
                    b_t.data_ptr() if b_t is not None else 0,
                    rank,
                    column,
                    width,
                )
                for table, value in zip(tables, entry, strict=True):
                    table.append(value)
                column += width
        return [value for table in tables for value in table]

    def step(self, slots: Sequence[int]) -> Step | None:
        """A step's view of its tokens' slots (one per token); None: no adapter in it."""
        if not any(slots):
            return None
        tables = self._tables
        which = torch.tensor([tables.index.get(s, -1) if s else -1 for s in slots])
        order = torch.argsort(which, stable=True)
        args = torch.tensor([len(slots), which.data_ptr(), order.data_ptr()])
        mode = next(mode for rows, mode in reversed(self._plan) if len(slots) >= rows)
        return Step(
            group_tokens(slots, self.device),
            which,
            order,
            tables,
            args,
            args.data_ptr(),
            tables.calls.get(mode, {}),
        )

    def apply(
        self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor, step: Step
    ) -> torch.Tensor:
        """`out` (the group's projection of `x`, [N, group out], a tensor of this step's own:
        changed in place) plus each adapter's delta at its tokens."""
        if self.kernel is not None and x.dtype == torch.bfloat16:
            # one call for every row, each with its own adapter (BGMV)
            self.kernel.lora_add(step.address, step.calls[(layer, group)], x.contiguous(), out)
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
