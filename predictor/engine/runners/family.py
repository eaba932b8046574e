"""What differs between the decoder families the runner serves (families.MODEL_TYPES), read once
from the model: the norms around each layer's attention and MLP (Llama's two, Gemma 2's four),
the final norm, Gemma 2's soft caps, Gemma 3's rotary table per layer type and sliding windows,
and Qwen3's per-head q/k norms. Qwen's biases and Phi-3's stored-fused projections are the
Linear layers' (kernels/int4_linear.py). And the attention's head sizes (`head_sizes`), which the
CPU and GPU runners both read here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from predictor.families import WINDOW_MASKED, check_family

Norm = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class HeadSizes:
    """The attention's heads as the config gives them, the same in every layer."""

    heads: int  # query heads
    kv_heads: int  # key and value heads (GQA: fewer, each shared by heads // kv_heads)
    head_dim: int
    scale: float  # the scores' factor (transformers' `scaling`: 1 / sqrt(head_dim) mostly)


def head_sizes(model: Any) -> HeadSizes:
    """The head sizes of a transformers causal LM, read once for a runner."""
    config = model.config
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    scale = float(model.model.layers[0].self_attn.scaling)
    return HeadSizes(heads, int(config.num_key_value_heads), int(head_dim), scale)


@dataclass(frozen=True)
class Family:
    # per layer: the norms before attention, after it, before the MLP and after it
    norms: list[tuple[Norm, Norm, Norm, Norm]]
    final_norm: Norm
    attention_cap: float | None  # Gemma 2: scores squashed by cap * tanh(x / cap)
    logit_cap: float | None  # and the final logits
    rope_kinds: list[str | None]  # Gemma 3: the rotary table of each layer's type
    windows: list[int | None]  # Gemma 3: a sliding layer's last keys (masked)
    qk_norms: list[tuple[Norm, Norm]] | None  # Qwen3: each head's q and k, before rotary


def family(model: Any, layers: list[Any]) -> Family:
    """The family traits of a transformers causal LM (UnsupportedModel for another type)."""
    config = model.config
    model_type = getattr(config, "model_type", "")
    check_family(model_type)
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(layers))
    per_type = getattr(model.model.rotary_emb, "layer_types", None) is not None
    window = getattr(config, "sliding_window", None)
    masked = model_type in WINDOW_MASKED and window is not None
    qk_norms = [
        (rms_norm(layer.self_attn.q_norm), rms_norm(layer.self_attn.k_norm))
        for layer in layers
        if getattr(layer.self_attn, "q_norm", None) is not None
    ]
    return Family(
        norms=[_layer_norms(layer) for layer in layers],
        final_norm=rms_norm(model.model.norm),
        attention_cap=getattr(config, "attn_logit_softcapping", None),
        logit_cap=getattr(config, "final_logit_softcapping", None),
        rope_kinds=[t if per_type else None for t in layer_types],
        windows=[
            int(window) if masked and t == "sliding_attention" else None  # type: ignore[arg-type]
            for t in layer_types
        ],
        qk_norms=qk_norms or None,
    )


def _layer_norms(layer: Any) -> tuple[Norm, Norm, Norm, Norm]:
    """The norms before attention, after it, before the MLP and after it: Llama's two (the
    others pass their input on), or Gemma 2's four (its post_attention_layernorm normalises
    attention's output; pre_feedforward_layernorm the MLP's input)."""
    post_mlp = getattr(layer, "post_feedforward_layernorm", None)
    if post_mlp is None:
        return (
            rms_norm(layer.input_layernorm),
            _unchanged,
            rms_norm(layer.post_attention_layernorm),
            _unchanged,
        )
    return (
        rms_norm(layer.input_layernorm),
        rms_norm(layer.post_attention_layernorm),
        rms_norm(layer.pre_feedforward_layernorm),
        rms_norm(post_mlp),
    )


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


def rms_norm(module: Any) -> Any:
    """transformers' Llama RMSNorm as one `torch.rms_norm` call (the same numbers in fp32,
    measured; in bf16 rounded once instead of twice), or the module itself if it is another."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not type(module).__name__.endswith("RMSNorm") or weight is None or eps is None:
        return module
    shape = (int(weight.shape[0]),)
    return lambda x: torch.rms_norm(x, shape, weight, float(eps))
