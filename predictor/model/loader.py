"""Load a GPTQ checkpoint folder with its tokenizer: device, dtype and threads chosen here."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from predictor.errors import CheckpointError

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: Any  # a transformers causal LM whose Linear layers are GPTQ kernels
    tokenizer: Any
    device: torch.device
    eos_ids: frozenset[int]
    pad_token_id: int
    context_length: int
    kernel: str  # the GPTQ kernel class in use


def check_checkpoint(path: Path) -> dict[str, Any]:
    """Return the checkpoint's quantization config, or raise CheckpointError saying why not."""
    if not path.is_dir():
        raise CheckpointError(f"model folder {path} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} is not a GPTQ checkpoint: it has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{config_file} cannot be read: {exc}") from exc
    quant = config.get("quantization_config") or {}
    if str(quant.get("quant_method", "")).lower() != "gptq":
        raise CheckpointError(
            f"{path} is not a GPTQ checkpoint: config.json has no GPTQ quantization_config"
        )
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise CheckpointError(f"{path} is not a GPTQ checkpoint: it has no weight files")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{path} has no tokenizer")
    return dict(quant)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("--device cuda was asked for, but no CUDA device is available")
    return torch.device(name)


def load_checkpoint(path: Path, device: str = "auto", threads: int = 1) -> LoadedModel:
    """Load a GPTQ checkpoint through transformers + optimum + gptqmodel."""
    check_checkpoint(path)
    torch.set_num_threads(threads)
    target = pick_device(device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(
            path, device_map=str(target) if target.type == "cpu" else {"": target.index or 0}
        )
    except Exception as exc:
        raise CheckpointError(f"{path} could not be loaded as a GPTQ model: {exc}") from exc
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=target,
        eos_ids=_eos_ids(model, tokenizer),
        pad_token_id=_pad_id(tokenizer),
        context_length=int(getattr(model.config, "max_position_embeddings", 2048)),
        kernel=_kernel_name(model),
    )


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _pad_id(tokenizer: Any) -> int:
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if isinstance(value, int):
            return value
    return 0


def _kernel_name(model: Any) -> str:
    for module in model.modules():
        if type(module).__module__.startswith("gptqmodel"):
            return type(module).__name__
    return "none"


def load_tokenizer_only(path: Path) -> LoadedModel:
    """The tokenizer of a checkpoint and no model: for the null runner (`--runner null`), which
    measures the serving stack without a forward pass. It never ends a request on its own."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise CheckpointError(f"{path} has no loadable tokenizer: {exc}") from exc
    return LoadedModel(
        model=None,
        tokenizer=tokenizer,
        device=torch.device("cpu"),
        eos_ids=frozenset(),
        pad_token_id=_pad_id(tokenizer),
        context_length=1 << 16,
        kernel="null",
    )
