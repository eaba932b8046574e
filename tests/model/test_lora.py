"""model/lora.py: a PEFT adapter read and checked against the model it adapts; each way an
adapter cannot be served is refused with its reason, before any of it is used."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from predictor.model.lora import AdapterError, load_adapter

SHAPES = {"q_proj": (16, 16), "k_proj": (16, 8), "v_proj": (16, 8), "o_proj": (16, 16),
          "gate_proj": (16, 32), "up_proj": (16, 32), "down_proj": (32, 16)}  # fmt: skip


def adapter(folder: Path, rank: int = 4, targets: tuple[str, ...] = ("q_proj", "down_proj"),
            **config: object) -> Path:  # fmt: skip
    tensors = {}
    for layer in range(2):
        for name in targets:
            owner = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{owner}.{name}"
            features_in, features_out = SHAPES.get(name, (16, 16))
            tensors[f"{prefix}.lora_A.weight"] = torch.ones(rank, features_in)
            tensors[f"{prefix}.lora_B.weight"] = torch.ones(features_out, rank)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    body = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": list(targets)}
    (folder / "adapter_config.json").write_text(json.dumps(body | config))
    return folder


def test_an_adapter_is_read_with_its_scale(tmp_path: Path) -> None:
    read = load_adapter("a", adapter(tmp_path / "a"), SHAPES, layers=2, max_rank=64)
    assert read.rank == 4 and read.scale == 2.0  # lora_alpha / r
    assert sorted(read.factors) == [(0, "down_proj"), (0, "q_proj"), (1, "down_proj"),
                                    (1, "q_proj")]  # fmt: skip
    a, b = read.factors[(1, "down_proj")]
    assert a.shape == (4, 32) and b.shape == (16, 4) and a.dtype == torch.float32
    rs = load_adapter("rs", adapter(tmp_path / "rs", use_rslora=True), SHAPES, 2, 64)
    assert rs.scale == pytest.approx(8 / math.sqrt(4))


def corrupt_shape(folder: Path) -> None:
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors = {key: torch.ones(99, 4),
               key.replace("lora_B", "lora_A"): torch.ones(4, 16)}  # fmt: skip
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def poison(folder: Path) -> None:
    """One weight of layer 1's down_proj B made a NaN."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    tensors[key][3, 1] = float("nan")
    save_file(tensors, str(folder / "adapter_model.safetensors"))


CASES: dict[str, tuple[dict[str, object], Callable[[Path], None] | None, str]] = {
    "rank over the limit": ({"rank": 128}, None, "rank 128 is not between 1 and 64"),
    "unknown target": ({"targets": ("q_proj", "lm_head")}, None, "lm_head"),
    "wrong shapes": ({}, corrupt_shape, "do not fit rank 4"),
    "no weights": ({}, lambda f: (f / "adapter_model.safetensors").unlink(), "no adapter_model"),
    "no config": ({}, lambda f: (f / "adapter_config.json").unlink(), "no adapter_config"),
    "dora": ({"use_dora": True}, None, "use_dora=True is not supported"),
    "trained bias": ({"bias": "all"}, None, "bias='all' is not supported"),
    "not lora": ({"peft_type": "IA3"}, None, "not a LoRA adapter"),
    "a layer too many": ({}, lambda f: None, "names no projection"),
    "a NaN weight": ({}, poison, "layer 1 down_proj: non-finite weights"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_adapter_is_refused_with_its_reason(case: str, tmp_path: Path) -> None:
    options, change, message = CASES[case]
    options = dict(options)
    rank = int(options.pop("rank", 4))  # type: ignore[call-overload]
    targets = options.pop("targets", ("q_proj", "down_proj"))
    folder = adapter(tmp_path / "bad", rank, targets, **options)  # type: ignore[arg-type]
    if change is not None:
        change(folder)
    layers = 1 if case == "a layer too many" else 2
    with pytest.raises(AdapterError, match=message):
        load_adapter("bad", folder, SHAPES, layers, max_rank=64)
