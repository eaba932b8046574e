"""Load a GPTQ checkpoint folder with its tokenizer: device, dtype and threads chosen here."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from predictor.config import FUSED_KERNELS, KERNELS
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


def load_checkpoint(
    path: Path, device: str = "auto", threads: int = 1, kernel: str = "auto"
) -> LoadedModel:
    """Load a GPTQ checkpoint through transformers + optimum + gptqmodel.

    `kernel`: "auto" (gptqmodel's choice), a gptqmodel backend name (its Linear kernel), or
    "dequantized": the 4-bit weights expanded once, here, into plain nn.Linear modules of the
    model's dtype (the same numbers, 4x the weight memory, the dense matmul of the platform).
    """
    if kernel not in KERNELS:
        raise CheckpointError(f"unknown kernel {kernel!r} (choose one of {', '.join(KERNELS)})")
    quant = check_checkpoint(path)
    torch.set_num_threads(threads)
    target = pick_device(device)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPTQConfig

    # "dequantized" reads the packed weights through gptqmodel's portable torch kernel
    # the runner's fused kernels all start from TorchAtenLinear's packed weights
    backend = {"auto": None, "dequantized": "gptq_torch"}.get(kernel, kernel)
    if kernel in FUSED_KERNELS:
        backend = "gptq_torch_aten"
    options: dict[str, Any] = {}
    if backend is not None:  # only the backend is taken from here; the rest from config.json
        options["quantization_config"] = GPTQConfig(bits=int(quant["bits"]), backend=backend)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(
            path,
            device_map=str(target) if target.type == "cpu" else {"": target.index or 0},
            **options,
        )
    except Exception as exc:
        raise CheckpointError(
            f"{path} could not be loaded as a GPTQ model with kernel {kernel}: {exc}"
        ) from exc
    model.eval()
    if kernel == "dequantized":
        dequantize_linears(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=target,
        eos_ids=_eos_ids(model, tokenizer),
        pad_token_id=_pad_id(tokenizer),
        context_length=int(getattr(model.config, "max_position_embeddings", 2048)),
        kernel=_kernel_name(model) if kernel != "dequantized" else "Linear (dequantized)",
    )


@torch.no_grad()
def dequantize_linears(model: Any) -> None:
    """Replace every GPTQ Linear by an nn.Linear holding its dequantized weight, in place.

    Each Linear is made on the meta device and given its weight: no random initialisation of
    weights that are overwritten at once (1.0 s of SmolLM2's 3.0 s, Xeon, 2 threads)."""
    dtype = model.get_input_embeddings().weight.dtype
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not type(child).__module__.startswith("gptqmodel"):
                continue
            linear = torch.nn.Linear(
                child.in_features, child.out_features, bias=child.bias is not None,
                device="meta", dtype=dtype,
            )  # fmt: skip
            weight = _dequantized_weight(child).to(dtype)  # [out, in]
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            if child.bias is not None:
                bias = child.bias.to(dtype=dtype, copy=True)
                linear.bias = torch.nn.Parameter(bias, requires_grad=False)
            setattr(parent, name, linear.eval())


def _dequantized_weight(module: Any) -> torch.Tensor:
    """scale[group] * (code - zero[group]) of a packed GPTQ module: [out_features, in_features].

    Packed layout (gptqmodel's GPTQ formats): qweight [in * bits / 32, out] int32, qzeros
    [groups, out * bits / 32] int32, scales [groups, out], g_idx [in] (the group of each input);
    qzero_format 1 (the v1 checkpoint format) stores each zero minus one.
    """
    bits = int(module.bits)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=module.qweight.device)
    mask = (1 << bits) - 1
    codes = (module.qweight.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask  # [in/pf, pf, out]
    codes = codes.reshape(-1, module.qweight.shape[1])[: module.in_features]  # [in, out]
    zeros = (module.qzeros.unsqueeze(2) >> shifts.view(1, 1, -1)) & mask  # [groups, out/pf, pf]
    zeros = zeros.reshape(module.qzeros.shape[0], -1)[:, : module.out_features]  # [groups, out]
    if module.qzero_format() == 1:
        zeros = zeros + 1
    groups = module.g_idx.long()  # [in]
    weight = module.scales.float()[groups] * (codes.float() - zeros.float()[groups])  # [in, out]
    return weight.t().contiguous()


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
