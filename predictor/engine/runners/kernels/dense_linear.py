"""Plain bf16 Linear layers (a checkpoint dequantized at load: 8-bit GPTQ, `--kernel
dequantized`) prepacked once for oneDNN, the layout its bf16 matmul reads fastest: torch's own
Linear repacks its weight at every call."""

from __future__ import annotations

from typing import Any

import torch

from predictor.engine.runners import internals
from predictor.engine.runners.kernels.int4_codes import note_once


class PrepackedLinear(torch.nn.Module):
    def __init__(self, prepacked: torch.Tensor, bias: torch.Tensor | None, shape: Any) -> None:
        super().__init__()
        self.out_features, self.in_features = int(shape[0]), int(shape[1])
        self.prepacked = prepacked
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = internals.onednn_linear(flat, self.prepacked)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def prepack(module: Any) -> PrepackedLinear | None:
    """The Linear prepacked, or None: not a plain bf16 Linear on a CPU, or no oneDNN here."""
    if type(module) is not torch.nn.Linear or module.weight.dtype != torch.bfloat16:
        return None
    if module.weight.device.type != "cpu" or not internals.onednn_prepack_available():
        return None
    weight = module.weight.detach().contiguous()
    try:
        prepacked = internals.onednn_reorder(weight, 16)
        internals.onednn_linear(torch.ones((1, weight.shape[1]), dtype=weight.dtype), prepacked)
    except RuntimeError as error:  # this CPU cannot (no AVX-512): the Linear stays as it is
        note_once(
            f"dense bf16 projections stay torch's Linear: oneDNN cannot prepack here "
            f"({type(error).__name__})"
        )
        return None
    bias = None if module.bias is None else module.bias.detach()
    return PrepackedLinear(prepacked, bias, weight.shape)


def prepack_layer(layer: Any) -> int:
    """Replace the layer's plain bf16 projections (its attention's and MLP's Linears, whatever
    the family names them) by prepacked ones, in place; how many."""
    done = 0
    for block in (layer.self_attn, layer.mlp):
        for name, child in list(block.named_children()):
            packed = prepack(child)
            if packed is not None:
                setattr(block, name, packed)
                done += 1
    return done
