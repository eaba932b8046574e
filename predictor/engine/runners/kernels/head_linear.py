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

    def kernel(self, int8: bool) -> Kernel:
        compiled = self.build()
        packed, n, k, matmul = self.packed, self.n, self.k, compiled.matmul
        assert packed is not None
        flag = int(int8)

        def run(x: torch.Tensor) -> torch.Tensor:  # [R, k] -> [R, n] fp32 logits
            x = x.to(torch.bfloat16).contiguous()
            rows = x.shape[0]
            out = torch.empty((rows, n), dtype=torch.float32)
            threads = torch.get_num_threads()
            if rows and matmul(
                x.data_ptr(), rows, k, packed.data_ptr(), n, out.data_ptr(), n, threads, flag
            ):
                raise MemoryError("int8_matmul: no memory for its activation buffer")
            return out

        return run
