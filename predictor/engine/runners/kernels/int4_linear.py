"""The runner's CPU linear layers, built from gptqmodel's TorchAtenLinear, projections fused.

TorchAtenLinear (gptqmodel's CPU kernel, torch's `_weight_int4pack_mm_for_cpu`) reorders every
input by `ret_idx` before the matmul, even when the checkpoint has no act-order and the order is
the identity (a gather per projection, every step). And q, k, v
(and gate, up) read the same input in three (two) calls. `Int4Linear` calls a kernel directly,
with the output columns of several such layers side by side, so a layer's q, k and v are one
call, and gate and up another: 7 kernel calls a layer become 4.

Layers with no adapter (and no bias, but for q, k and v: Qwen2's, added after the fused matmul)
are fused; act-order's reordering, where a checkpoint has one, is one gather of the input per
fused call (q, k and v share it) instead of one per projection. Each fused
layer can run several kernels (`config.FUSED_KERNELS`): torch's int4 op; the weights expanded
once, exactly, to bf16 and prepacked for oneDNN (4x the int4 bytes); or int4_matmul.c over
the same 4-bit codes repacked (fp32 or int8 activations, per instruction set). Which one serves
a step of so many rows is the autotune's choice (autotune.py), measured on this machine;
a kernel no bucket chose is dropped. Only the runner uses them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from predictor.engine.runners import internals
from predictor.engine.runners.kernels.autotune_cache import source_digest
from predictor.engine.runners.kernels.int4_codes import (
    codes_buffer,
    dequantize_codes,
    give_back,
    gptq_codes,
    int4pack_codes,
    note_once,
    repack_codes,
    scratch,
)
from predictor.engine.runners.kernels.invariance import ROWWISE, rowwise
from predictor.engine.runners.kernels.layout_store import LayoutStore, fingerprint
from predictor.engine.runners.native import bindings as native

logger = logging.getLogger(__name__)

INT4_OP, PREPACKED = "int4_op", "prepacked_bf16"
Kernel = Callable[[torch.Tensor], torch.Tensor]  # [N, K] bf16 -> [N, out] bf16


class Int4Linear(torch.nn.Module):
    """The output columns of `parts` side by side, as one matmul, by the kernel `plan` names
    for the step's row count (until a plan is set: torch's int4 op)."""

    qweight: torch.Tensor
    scales_and_zeros: torch.Tensor

    bias: torch.Tensor | None
    order: torch.Tensor | None

    def __init__(self, parts: Sequence[internals.AtenPacked]) -> None:
        super().__init__()
        first = parts[0]
        self.group_size = int(first.group_size)
        self.in_features = int(first.in_features)
        self.splits = [int(p.out_features) for p in parts]
        self.out_features = sum(self.splits)
        # torch's int4pack [N, K / 2] of the parts side by side: theirs where they were packed,
        # else packed from the codes only if the int4 op serves (`_pack_int4`); GPTQ's tensors
        # as loaded are read until a plan is set (`use`), then let go
        packed = all(p.int4pack for p in parts)
        empty = torch.empty(0, dtype=torch.uint8)
        qweight = torch.cat([p.qweight for p in parts]) if packed else empty
        self._parts = [] if packed else list(parts)
        scales_and_zeros = torch.cat([p.scales_and_zeros for p in parts], dim=1)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        # Qwen2's q, k and v biases side by side (bf16), added after whichever kernel ran
        biases = [p.bias for p in parts]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    torch.zeros(p.out_features) if b is None else b.detach().float()
                    for p, b in zip(parts, biases, strict=True)
                ]
            ).to(torch.bfloat16)
        self.register_buffer("bias", bias)
        # act-order: TorchAtenLinear stored the rows group by group (ExLlama's reordering, once
        # at load), so the input is gathered into that order: one gather for q, k and v, which
        # read one input and so share GPTQ's order
        order = first.order.long()
        identity = torch.equal(order, torch.arange(order.numel()))
        self.register_buffer("order", None if identity else order)
        self._kernels: dict[str, Kernel] = {INT4_OP: self._int4_op}
        self._native_weight: torch.Tensor | None = None  # int4_matmul.c's layout, uint8
        self._codes_read: torch.Tensor | None = None  # while kernels are built (`_codes`)
        self._by_rows: list[Kernel] = [self._int4_op]  # [rows] -> kernel; the last for more
        self.plan: list[tuple[int, str]] = [(1, INT4_OP)]
        self.layouts: LayoutStore | None = None  # the runner's, where layouts are kept on disk

    @property
    def shape(self) -> tuple[int, int, int]:
        """(out features, in features, group size): what the autotune measures per."""
        return (self.out_features, self.in_features, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != torch.bfloat16:  # the runner's own calls are [N, K] bf16
            flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
            return self(flat).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        rows = x.shape[0]
        table = self._by_rows
        if self.order is not None:
            x = x.index_select(1, self.order)
        out = table[rows if rows < len(table) else -1](x)
        return out if self.bias is None else out.add_(self.bias)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(out.split(self.splits, dim=-1))

    def candidates(self, every_isa: bool = False) -> list[str]:
        """The kernels this layer could run on this machine (built or not): the native ones in
        the widest instruction set only, unless `every_isa` (narrower ones never measured
        faster here, and each costs autotune time)."""
        names = [INT4_OP]
        if prepack_available():
            names.append(PREPACKED)
        isas = native.usable_isas()
        if self.in_features % self.group_size == 0 and self.group_size % 8 == 0:
            for isa in isas if every_isa else isas[:1]:
                names.append(f"native_f32_{isa}")
                if self.group_size % 32 == 0:
                    names.append(f"native_i8_{isa}")
        return names

    def kernel(self, name: str) -> Kernel:
        """The kernel `name` (see config.FUSED_KERNELS), built now if it is not yet; ValueError
        naming why where it cannot run here (native.NativeUnavailable where it fails to build)."""
        name = resolve_kernel(name)
        if name not in self._kernels:
            if name.startswith(ROWWISE):
                self._kernels[name] = rowwise(self.kernel(name.removeprefix(ROWWISE)))
            elif name == PREPACKED:
                self._kernels[name] = self._prepacked()
            elif name.startswith("native_"):
                self._kernels[name] = self._native(name)
            else:
                raise ValueError(f"unknown kernel {name!r}")
        return self._kernels[name]

    def use(self, plan: Sequence[tuple[int, str]], final: bool = True) -> None:
        """Run `plan`: (fewest rows, kernel) pairs, the first at 1 row; drop unused kernels.
        Not `final`: a later call completes it, so the 4-bit weights stay readable. Safe while
        another thread runs the layer: it switches to the new plan between two calls."""
        plan = sorted((int(rows), resolve_kernel(name)) for rows, name in plan)
        if not plan or plan[0][0] != 1:
            raise ValueError("a plan starts at 1 row")
        if not self._readable() and any(
            name not in self._kernels or name == INT4_OP for _, name in plan
        ):
            raise ValueError("the 4-bit weights were dropped: only the built kernels remain")
        kernels = {name: self.kernel(name) for _, name in plan}
        if INT4_OP in kernels:
            self._pack_int4()
        self._by_rows = [kernels[plan[0][1]]]  # index 0: never used (no step has 0 rows)
        for rows in range(1, plan[-1][0] + 1):
            self._by_rows.append(kernels[[n for low, n in plan if low <= rows][-1]])
        self.plan = list(plan)
        self._kernels = {INT4_OP: self._int4_op, **kernels}
        self._let_codes_go()
        if not final:
            return
        self._parts = []  # the checkpoint's own tensors: the runner lets them go
        bases = {name.removeprefix(ROWWISE) for name in kernels}  # what the kernels read
        if not any(name.startswith("native_") for name in bases) and self.qweight.numel():
            self._native_weight = None
        elif INT4_OP not in bases and self.qweight.numel():
            # the native layout serves: torch's int4pack copy goes (a later plan may then use
            # only the kernels built by now)
            self.qweight = torch.empty(0, dtype=self.qweight.dtype)
            if PREPACKED not in bases:  # nor do the scales and zeros, read only at building
                self.scales_and_zeros = torch.empty(0, dtype=self.scales_and_zeros.dtype)

    def _int4_op(self, x: torch.Tensor) -> torch.Tensor:
        if not self.qweight.numel():
            if not self._readable():
                raise RuntimeError("the int4pack weights were dropped: plan the int4 op to use it")
            self._pack_int4()  # before a plan is set (evaluation, tests): packed at first use
        return internals.int4pack_mm(x, self.qweight, self.group_size, self.scales_and_zeros)

    def _readable(self) -> bool:
        """Whether the codes can still be read (for a kernel not built yet)."""
        return bool(self._parts) or bool(self.qweight.numel())

    def _pack_int4(self) -> None:
        if not self.qweight.numel():
            self.qweight = internals.convert_to_int4pack(self._codes().int()).contiguous()

    def _codes(self) -> torch.Tensor:
        """The weights' codes [N, K] (uint8), read once for every kernel built from them (`use`
        lets them go): unpacked from GPTQ's tensors as loaded, else read back from int4pack."""
        if self._codes_read is None:
            if self._parts:
                size = self.out_features * self.in_features
                codes = codes_buffer(size).view(self.out_features, -1)
                low = 0
                for part in self._parts:
                    gptq_codes(part, codes[low : low + part.out_features])
                    low += part.out_features
                self._codes_read = codes
            else:
                self._codes_read = int4pack_codes(self.qweight, self.out_features, self.in_features)
        return self._codes_read

    def _let_codes_go(self) -> None:
        if self._codes_read is not None and self._parts:
            give_back(self._codes_read)  # the next layer's codes are unpacked into it
        self._codes_read = None

    def _prepacked(self) -> Kernel:
        weight = None
        if internals.onednn_prepack_available():
            dense = dequantize_codes(
                self._codes(), self.scales_and_zeros, self.group_size, scratch(self.shape)
            )
            weight = reorder(dense)  # a copy: the scratch serves the next layer
        if weight is None:
            raise ValueError("oneDNN's prepacked bf16 linear is not available on this CPU")
        return lambda x: internals.onednn_linear(x, weight)

    def _layout(self, compiled: native.Int4Kernel, isa: str) -> torch.Tensor:
        """int4_matmul.c's layout of the weights: read back from `layouts` where a start made
        it for these weights, else repacked from the codes (and kept there)."""
        size = native.Int4Kernel.packed_bytes(self.out_features, self.in_features, self.group_size)
        key = None
        if self.layouts is not None and self._readable():
            tensors = [t for p in self._parts for t in (p.qweight, p.scales_and_zeros, p.order)]
            if not self._parts:
                tensors = [self.qweight, self.scales_and_zeros]
            key = fingerprint(tensors, "int4", isa, self.shape, self.splits, source_digest())
            stored = self.layouts.read(key, size)
            if stored is not None:
                return stored
        weight = repack_codes(
            compiled, self._codes(), self.scales_and_zeros, self.group_size, self.in_features
        )
        if key is not None and self.layouts is not None:
            self.layouts.write(key, weight)
        return weight

    def _native(self, name: str) -> Kernel:
        _, act, isa = name.split("_", 2)
        if name not in self.candidates(every_isa=True):
            raise ValueError(f"{name} cannot run here ({self.shape}, CPU {native.usable_isas()})")
        compiled = native.int4_matmul(isa)
        if self._native_weight is None:
            self._native_weight = self._layout(compiled, isa)
        weight, n, k, group = (
            self._native_weight,
            self.out_features,
            self.in_features,
            self.group_size,
        )
        int8 = int(act == "i8")
        matmul = compiled.matmul

        def run(x: torch.Tensor) -> torch.Tensor:
            x = x.contiguous()
            rows = x.shape[0]
            out = torch.empty((rows, n), dtype=torch.bfloat16)
            threads = torch.get_num_threads()
            if rows and matmul(
                x.data_ptr(), rows, k, weight.data_ptr(), n, group, out.data_ptr(), n, threads, int8
            ):
                raise MemoryError("int4_matmul: no memory for its activation buffer")
            return out

        return run


def resolve_kernel(name: str) -> str:
    """native_f32 / native_i8 (no instruction set named) -> the widest this CPU has."""
    if name in ("native_f32", "native_i8"):
        isas = native.usable_isas()
        if not isas:
            raise ValueError(f"{name}: this CPU has neither AVX2 + FMA nor AVX-512")
        return f"{name}_{isas[0]}"
    return name


@functools.lru_cache(maxsize=1)
def prepack_available() -> bool:
    """Whether oneDNN's prepacked bf16 linear works here (it refuses CPUs without avx512bw/vl/dq
    or avx_ne_convert)."""
    return reorder(torch.ones((16, 16), dtype=torch.bfloat16)) is not None


def reorder(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 [N, K] weight prepacked for oneDNN's linear, or None where this torch lacks it."""
    if not internals.onednn_prepack_available():
        return None
    try:
        prepacked = internals.onednn_reorder(weight.contiguous(), 16)
        probe = torch.ones((1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
        internals.onednn_linear(probe, prepacked)
        return prepacked
    except RuntimeError as error:  # this CPU cannot (no AVX-512): the caller keeps its matmul
        note_once(
            f"oneDNN's prepacked bf16 linear is unavailable here ({type(error).__name__}): "
            "it is not a candidate"
        )
        return None


def _one_order(parts: Sequence[internals.AtenPacked]) -> bool:
    """The parts gather their input into one order (act-order's: those reading one input)."""
    first = parts[0].order
    return all(torch.equal(p.order, first) for p in parts[1:])


@dataclass
class FusedLayer:
    """A decoder layer's projections as four calls: qkv, o, gate_up, down."""

    KINDS = ("qkv", "o", "gate_up", "down")

    qkv: Int4Linear
    o: Int4Linear
    gate_up: Int4Linear
    down: Int4Linear


def projections(layer: Any) -> tuple[list[Any], Any, list[Any], Any]:
    """A decoder layer's (q, k, v), o, (gate, up) and down Linears: Phi-3 stores q, k and v as
    one `qkv_proj` and gate and up as one `gate_up_proj` (gate first), the others apart."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
    gate_up = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
    return qkv, attn.o_proj, gate_up, mlp.down_proj


def fuse_layer(layer: Any) -> FusedLayer | str:
    """The layer's projections fused, or why not (the model's own modules then serve it, more
    slowly: the runner logs the reason): one not a plain packed TorchAtenLinear (another
    kernel, a dequantized checkpoint, a GPU), q/k/v or gate/up of different group sizes or
    input orders.

    The model keeps its modules (transformers' own forward still works, e.g. for evaluation);
    the fused copies add the packed weights once more (about 50 MB for SmolLM2-135M)."""
    qkv_modules, o_module, gate_up_modules, down_module = projections(layer)
    qkv = [internals.aten_packed(m, bias=True) for m in qkv_modules]  # Qwen2's biased q, k, v
    rest = [internals.aten_packed(m) for m in (*gate_up_modules, o_module, down_module)]
    for part in (*qkv, *rest):
        if isinstance(part, str):
            return part
    packed_qkv = [p for p in qkv if not isinstance(p, str)]
    gate_up = [p for p in rest[: len(gate_up_modules)] if not isinstance(p, str)]
    o, down = rest[-2], rest[-1]
    assert not isinstance(o, str) and not isinstance(down, str)
    if len({p.group_size for p in packed_qkv}) != 1 or len({p.group_size for p in gate_up}) != 1:
        return "q/k/v or gate/up are quantized with different group sizes"
    if not _one_order(packed_qkv) or not _one_order(gate_up):
        return "q/k/v or gate/up gather their input in different act-orders"
    return FusedLayer(
        Int4Linear(packed_qkv), Int4Linear([o]), Int4Linear(gate_up), Int4Linear([down])
    )
