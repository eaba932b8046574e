"""The runner's native small ops (layer_ops.c through bindings.py), on tensors.

A Llama layer at a few rows is mostly dispatch: torch's bf16 rms_norm alone is ~10 ops, 22 us
at 1 row of 576 (measured here), twice a layer; the rotary pass and the cache write, and SwiGLU,
are 9 more. These do each in one call: the residual add fused into the next norm, q and k
rotated and k, v written to the paged cache in one pass, SwiGLU in one. Used where native decode
attention is (a bf16 Llama on the CPU, `--attention native|auto`), else the runner's torch ops.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from predictor.engine.runners.native.bindings import LayerOps, NativeUnavailable, layer_ops

logger = logging.getLogger(__name__)


class LayerKernels:
    def __init__(self, ops: LayerOps, layers: list[Any], final_norm: Any) -> None:
        self._ops = ops
        norms = []
        for layer in layers:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
        norms.append(final_norm)
        # per norm: (weight, eps); the runner asks by index: 2 i, 2 i + 1, then the final one
        self.norms = [(n.weight.detach().contiguous(), float(n.variance_epsilon)) for n in norms]

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, index: int
    ) -> torch.Tensor:
        """hidden += delta in place (when given), then norm `index` of it: [N, hidden]."""
        weight, eps = self.norms[index]
        out = torch.empty_like(hidden)
        pointer = None if delta is None else delta.contiguous().data_ptr()
        rows, dim = hidden.shape
        self._ops.add_rms_norm(
            hidden.data_ptr(),
            pointer,
            weight.data_ptr(),
            eps,
            out.data_ptr(),
            rows,
            dim,
            torch.get_num_threads(),
        )
        return out

    def rope_write(
        self,
        qkv: torch.Tensor,  # [N, heads + 2 kv_heads, head_dim], contiguous
        heads: int,
        kv_heads: int,
        cos: torch.Tensor,  # [N, head_dim] bf16, contiguous
        sin: torch.Tensor,
        pool: torch.Tensor,  # [2 kv_heads, slots, head_dim]
        slots: torch.Tensor,  # [N] int64
    ) -> None:
        self._ops.rope_write(
            qkv.data_ptr(),
            qkv.shape[0],
            heads,
            kv_heads,
            cos.data_ptr(),
            sin.data_ptr(),
            pool.data_ptr(),
            pool.shape[1],
            slots.data_ptr(),
            torch.get_num_threads(),
        )

    def lora_add(
        self,
        step: int,  # address of int64 [rows, which's address, order's address]: each row's
        # adapter's row in the tables (-1: none), and the rows grouped by adapter
        group: int,  # address of the projection group's int64 table (lora.py: Tables)
        x: torch.Tensor,  # [N, in] bf16, rows contiguous
        out: torch.Tensor,  # [N, n] bf16, changed in place
    ) -> None:
        self._ops.lora_add(step, group, x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0))

    @property
    def lora_int8(self) -> bool:
        """Whether lora_add has its int8 mode here (AVX-512 VNNI)."""
        return bool(self._ops.lora_int8())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [N, 2 inner] (gate first): [N, inner]."""
        rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inner), dtype=gate_up.dtype)
        self._ops.silu_mul(
            gate_up.contiguous().data_ptr(), rows, inner, out.data_ptr(), torch.get_num_threads()
        )
        return out


def layer_kernels(model: Any, head_dim: int, cache_dir: Path | None = None) -> LayerKernels | None:
    """The kernels for this model (their library kept in `cache_dir` where given), or None
    where they do not apply (not bf16 RMSNorm + SiLU Llama layers) or cannot be built (no
    compiler: logged)."""
    decoder = model.model
    norms = [decoder.norm]
    for layer in decoder.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    if any(
        not type(n).__name__.endswith("RMSNorm")
        or getattr(n, "weight", None) is None
        or n.weight.dtype != torch.bfloat16
        or getattr(n, "variance_epsilon", None) is None
        for n in norms
    ):
        return None
    if getattr(model.config, "hidden_act", "silu") != "silu":
        return None
    try:
        return LayerKernels(layer_ops(head_dim, cache_dir), list(decoder.layers), decoder.norm)
    except NativeUnavailable as error:
        logger.warning("native layer ops unavailable, using torch's: %s", error)
        return None
