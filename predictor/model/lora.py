"""LoRA adapters in PEFT's format, read and checked against the model they adapt.

A folder holds `adapter_config.json` (`peft_type` LORA, `r`, `lora_alpha`, `target_modules`,
`use_rslora`) and `adapter_model.safetensors` (per adapted Linear of layer i,
`base_model.model.model.layers.{i}.<module>.lora_A.weight` [r, in] and `lora_B.weight` [out, r]).
The adapted Linear computes W x + scale * B (A x), scale = lora_alpha / r (lora_alpha / sqrt(r)
with rsLoRA). Everything that would make that wrong or half-applied is refused with the reason
(`AdapterError`), before any of it is used: a rank over the limit, an unknown target module,
shapes that are not the model's, DoRA, trained biases or saved modules, missing files.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from predictor.errors import CheckpointError
from predictor.types import run_to_end

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# the projections an adapter may target, by the name PEFT gives them
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


class AdapterError(CheckpointError):
    """An adapter that cannot be served as it is; the message says why."""


@dataclass(frozen=True)
class Adapter:
    """One adapter's low-rank factors: (layer, module) -> (A [r, in], B [out, r]), fp32."""

    name: str
    rank: int
    scale: float
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(
    name: str, folder: Path, shapes: dict[str, tuple[int, int]], layers: int, max_rank: int
) -> Adapter:
    """The adapter in `folder`, checked against the model: `shapes` gives each projection's
    (in, out) features, `layers` the decoder layers."""
    return run_to_end(reading_adapter(name, folder, shapes, layers, max_rank))


def reading_adapter(
    name: str, folder: Path, shapes: dict[str, tuple[int, int]], layers: int, max_rank: int
) -> Generator[None, None, Adapter]:
    """`load_adapter` a slice at a time (the file, its tensors' checks, their values): what
    the step loop runs between steps when an adapter is loaded at run time."""
    config = _config(folder)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise AdapterError(
            f"adapter '{name}': rank {rank!r} is not between 1 and {max_rank} (--max-lora-rank)"
        )
    if not isinstance(alpha, int | float):
        raise AdapterError(f"adapter '{name}': lora_alpha {alpha!r} is not a number")
    for key, allowed in (
        ("use_dora", (False, None)),
        ("bias", ("none", None)),
        ("modules_to_save", (None, [])),
        ("fan_in_fan_out", (False, None)),
        ("rank_pattern", ({}, None)),
        ("alpha_pattern", ({}, None)),
    ):
        if config.get(key) not in allowed:
            raise AdapterError(f"adapter '{name}': {key}={config[key]!r} is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    unknown = sorted(set(targets or []) - set(MODULES))
    if not targets or unknown:
        raise AdapterError(
            f"adapter '{name}': target modules {unknown or targets!r} are not "
            f"among {', '.join(MODULES)}"
        )
    factors = yield from _factors(name, folder, shapes, layers, rank)
    if not factors:
        raise AdapterError(f"adapter '{name}': {WEIGHTS} holds no LoRA factors")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return Adapter(name, rank, float(scale), factors)


def _config(folder: Path) -> dict[str, Any]:
    for file in (CONFIG, WEIGHTS):
        if not (folder / file).is_file():
            raise AdapterError(f"adapter folder {folder}: no {file}")
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter folder {folder}: {CONFIG} is not JSON ({exc})") from exc
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter folder {folder}: not a LoRA adapter ({CONFIG})")
    return config


def _factors(
    name: str, folder: Path, shapes: dict[str, tuple[int, int]], layers: int, rank: int
) -> Generator[None, None, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(folder / WEIGHTS))
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"adapter '{name}': {WEIGHTS} cannot be read ({exc})") from exc
    yield
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"adapter '{name}': unexpected tensor {key}")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in shapes or layer >= layers:
            raise AdapterError(f"adapter '{name}': {key} names no projection of this model")
        halves.setdefault((layer, module), {})[half] = tensor
    factors = {}
    for (layer, module), pair in sorted(halves.items()):
        a, b = pair.get("A"), pair.get("B")
        features_in, features_out = shapes[module]
        where = f"adapter '{name}', layer {layer} {module}"
        if a is None or b is None:
            raise AdapterError(f"{where}: lora_A or lora_B is missing")
        if tuple(a.shape) != (rank, features_in) or tuple(b.shape) != (features_out, rank):
            raise AdapterError(
                f"{where}: factors {tuple(a.shape)} and {tuple(b.shape)} do not "
                f"fit rank {rank} and the model's {features_in} -> "
                f"{features_out}"
            )
        factors[(layer, module)] = (a.float().contiguous(), b.float().contiguous())
    yield
    # finite weights: each factor's sum is (a NaN or an infinity carries into it; finite values
    # that large are no adapter's either), one isfinite over the sums rather than one a factor
    sums = torch.stack([half.sum() for pair in factors.values() for half in pair])
    if not bool(torch.isfinite(sums).all()):
        bad = int(torch.isfinite(sums).logical_not().nonzero()[0]) // 2
        layer, module = list(factors)[bad]
        raise AdapterError(f"adapter '{name}', layer {layer} {module}: non-finite weights")
    return factors
