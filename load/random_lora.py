"""Random LoRA adapters in PEFT's format for a checkpoint's shapes (tests and load/bench_lora.py:
no hub downloads, so adapters are made here, as the random-weight checkpoints are)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Each projection's (in, out) features, from a transformers config.json."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config["num_key_value_heads"] * head_dim
    inner = config["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inner),
            "up_proj": (hidden, inner), "down_proj": (inner, hidden)}  # fmt: skip


def write_adapter(
    folder: Path,
    model_dir: Path,
    rank: int,
    seed: int,
    targets: Sequence[str] = ATTENTION + MLP,
    std: float = 1.0,
) -> Path:
    """A PEFT adapter of random factors (lora_alpha = 2 r) on `targets` of every layer of the
    checkpoint in `model_dir`; B is not zero, as training leaves it."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    sizes = shapes(config)
    for layer in range(config["num_hidden_layers"]):
        for name in targets:
            features_in, features_out = sizes[name]
            owner = "self_attn" if name in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{owner}.{name}"
            a = torch.randn(rank, features_in, generator=generator) * std
            b = torch.randn(features_out, rank, generator=generator) * std
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    body = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets)}
    (folder / "adapter_config.json").write_text(json.dumps(body))
    return folder
