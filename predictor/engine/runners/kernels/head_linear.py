"""lm_head's CPU kernels, each built on demand for the autotune to time (autotune.py): the
module as loaded, an fp32 copy, a oneDNN-prepacked bf16 copy, and int8_matmul.c over a Q8_0-like
copy with fp32 or int8 activations."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from predictor.engine.runners import internals
from predictor.engine.runners.kernels.autotune_cache import source_digest
from predictor.engine.runners.kernels.int4_linear import (
    PREPACKED,
    Kernel,
    prepack_available,
    reorder,
)
from predictor.engine.runners.kernels.layout_store import LayoutStore, fingerprint
from predictor.engine.runners.native import bindings as native


def head_candidates(
    module: Any, layouts: LayoutStore | None = None
) -> dict[str, Callable[[], Kernel]]:
    """Ways to run a bias-free CPU `nn.Linear` (lm_head), each built on demand: the module
    itself, and for bf16 weights an fp32 copy (bf16 matmuls are emulated on CPUs without
    AVX-512 BF16) and a oneDNN-prepacked bf16 copy (each costs the weight's bytes again). Other
    modules (fp32 weights, whose numbers the exactness tests hold, GPU) keep the module only.
    The int8 copy is kept in `layouts` where given (layout_store.py)."""
    found: dict[str, Callable[[], Kernel]] = {"module": lambda: module}
    weight = getattr(module, "weight", None)
    if (
        not isinstance(module, torch.nn.Linear)
        or module.bias is not None
        or weight is None
        or weight.dtype != torch.bfloat16
        or weight.device.type != "cpu"
    ):
        return found

    def fp32() -> Kernel:
        full = weight.detach().float()
        return lambda x: torch.nn.functional.linear(x.float(), full)

    def prepacked() -> Kernel:
        packed = reorder(weight.detach())
        if packed is None:
            raise ValueError("oneDNN's prepacked bf16 linear is not available on this CPU")
        return lambda x: internals.onednn_linear(x, packed)

    found["fp32"] = fp32
    if prepack_available():
        found[PREPACKED] = prepacked
    if weight.shape[1] % 32 == 0:
        for isa in native.usable_isas()[:1]:  # the widest, as for the int4 layers
            table = _Int8Table(weight, isa, layouts)
            for act in ("i8", "f32"):
                found[f"{INT8_HEAD}_{act}_{isa}"] = functools.partial(table.kernel, act == "i8")
    return found


INT8_HEAD = "int8"  # lm_head kernels int8_{i8|f32}_{isa}: int8_matmul.c over a Q8_0-like copy


class _Int8Table:
    """A bf16 [n, k] weight quantized once to int8_matmul.c's layout (per 32 inputs of a row, a
    bf16 scale: llama.cpp's Q8_0), built at the first kernel asked for; shared by both kinds of
    activations."""

    def __init__(self, weight: torch.Tensor, isa: str, layouts: LayoutStore | None) -> None:
        self._weight = weight
        self.isa = isa
        self.packed: torch.Tensor | None = None
        self.n, self.k = int(weight.shape[0]), int(weight.shape[1])
        self.layouts: LayoutStore | None = layouts

    def build(self) -> native.Int8Kernel:
        try:
            compiled = native.int8_matmul(self.isa)
        except native.NativeUnavailable as error:
            raise ValueError(str(error)) from error
        if self.packed is None:
            source = self._weight.detach().contiguous()
            size = compiled.nbytes(self.n, self.k)
            key = None
            if self.layouts is not None:
                key = fingerprint([source], "int8 head", self.isa, source_digest())
                self.packed = self.layouts.read(key, size)
            if self.packed is None:
                packed = torch.empty(size, dtype=torch.uint8)
                compiled.quantize(source.data_ptr(), self.n, self.k, packed.data_ptr())
                self.packed = packed
                if key is not None and self.layouts is not None:
                    self.layouts.write(key, packed)
        return compiled

    def kernel(self, int8: bool) -> Int8Head:
        compiled = self.build()
        assert self.packed is not None
        return Int8Head(self.packed, self.n, self.k, compiled, int(int8))


class Int8Head:
    """lm_head through int8_matmul.c (`__call__`: [R, k] -> [R, n] fp32 logits), and the
    table's rows read back (`rows`): a tied embedding's lookup, once the bf16 table is let go."""

    def __init__(
        self, packed: torch.Tensor, n: int, k: int, compiled: native.Int8Kernel, flag: int
    ) -> None:
        self.packed, self.n, self.k, self._compiled, self._flag = packed, n, k, compiled, flag

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16).contiguous()
        rows = x.shape[0]
        out = torch.empty((rows, self.n), dtype=torch.float32)
        threads = torch.get_num_threads()
        if rows and self._compiled.matmul(
            x.data_ptr(),
            rows,
            self.k,
            self.packed.data_ptr(),
            self.n,
            out.data_ptr(),
            self.n,
            threads,
            self._flag,
        ):
            raise MemoryError("int8_matmul: no memory for its activation buffer")
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight as the table holds them (code x scale), bf16 [len(ids), k]."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty((len(ids), self.k), dtype=torch.bfloat16)
        if self._compiled.rows(
            self.packed.data_ptr(), self.n, self.k, ids.data_ptr(), len(ids), out.data_ptr()
        ):
            raise IndexError(f"int8_rows: a token id past the table's {self.n} rows")
        return out
