"""Load a GPTQ checkpoint folder with its tokenizer: device, dtype and threads chosen here."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from predictor.config import FUSED_KERNELS, KERNELS
from predictor.errors import CheckpointError, UnsupportedModel
from predictor.families import CONTEXT_WINDOWED, GPU_MODEL_TYPES, WINDOW_MASKED, check_family
from predictor.model.gptq import (
    GPTQLayout,
    GPTQLinear,
    gptq_linear,
    load_gptq_model,
    read_module,
)

log = logging.getLogger(__name__)

QUANTIZE_CONFIG = "quantize_config.json"  # AutoGPTQ's, beside a config.json without one
ATEN_GROUPS = (16, 32, 64, 128)  # gptqmodel 7.6's TorchAtenLinear: the group sizes it takes


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
    quant = quantization_config(path, config)
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise CheckpointError(f"{path} is not a GPTQ checkpoint: it has no weight files")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{path} has no tokenizer")
    check_family(str(config.get("model_type", "")))
    check_rotary(config)
    if int(quant.get("bits", 4)) not in (4, 8):
        raise UnsupportedModel(
            f"{quant.get('bits')}-bit GPTQ is not supported (supported: 4 and 8 bits)"
        )
    GPTQLayout.from_config(quant)  # the checkpoint format
    return dict(quant)


def quantization_config(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The GPTQ settings: config.json's `quantization_config` (transformers, optimum, gptqmodel),
    else AutoGPTQ's `quantize_config.json` beside it (TheBloke's checkpoints: no quant_method,
    the v1 format). CheckpointError where neither says GPTQ."""
    quant = config.get("quantization_config")
    side = path / QUANTIZE_CONFIG
    if not quant and side.is_file():
        try:
            quant = {"quant_method": "gptq", "checkpoint_format": "gptq"}
            quant |= json.loads(side.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{side} cannot be read: {exc}") from exc
    quant = quant or {}
    if str(quant.get("quant_method", "")).lower() != "gptq":
        raise CheckpointError(
            f"{path} is not a GPTQ checkpoint: config.json has no GPTQ quantization_config "
            f"and there is no {QUANTIZE_CONFIG}"
        )
    return dict(quant)


def check_rotary(config: dict[str, Any]) -> None:
    """Refuse rotary embeddings the runner does not apply, from config.json alone (a second,
    not minutes into loading the weights), as the family is (families.check_family)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:  # Phi-4-mini's 0.75: the runner rotates every dimension of a head
        raise UnsupportedModel(
            f"partial_rotary_factor {partial} is not supported (only 1.0: rotary on whole heads)"
        )


def context_length(config: Any) -> int:
    """The tokens a request may span: max_position_embeddings, or a sliding window where the
    model attends through one (families.CONTEXT_WINDOWED; Qwen2/3 with use_sliding_window;
    Gemma 3 masks its windows instead). Capping the context
    at the window keeps every key a query may see inside it, so no window mask is needed."""
    length = int(getattr(config, "max_position_embeddings", 2048))
    window = getattr(config, "sliding_window", None)
    model_type = getattr(config, "model_type", "")
    uses_window = model_type in CONTEXT_WINDOWED or bool(
        getattr(config, "use_sliding_window", False) and model_type not in WINDOW_MASKED
    )
    if uses_window and window:
        length = min(length, int(window))
    return length


def attention_shape(path: Path) -> tuple[int, int] | None:
    """(head_dim, query heads per KV head) as config.json states them (the runner's native
    kernels are compiled for these), or None where it nests them (a multimodal config) or
    cannot be read (check_checkpoint says why, next)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)  # transformers' default: no grouping
    if not isinstance(heads, int) or not heads or not isinstance(kv_heads, int) or not kv_heads:
        return None
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    return (int(head_dim), heads // kv_heads) if head_dim else None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("--device cuda was asked for, but no CUDA device is available")
    return torch.device(name)


def load_checkpoint(
    path: Path,
    device: str = "auto",
    threads: int = 1,
    kernel: str = "auto",
    dtype: torch.dtype | None = None,
    served: bool = False,
) -> LoadedModel:
    """Load a GPTQ checkpoint with its tokenizer.

    On a CPU, through transformers + optimum + gptqmodel: `kernel` "auto" (gptqmodel's choice)
    or a gptqmodel backend name (its Linear kernel). On a GPU, and for "dequantized" anywhere,
    the checkpoint is read by model/gptq.py (no gptqmodel): each GPTQ Linear a GPTQLinear, whose
    tensors the GPU runner's own kernels serve, or, for "dequantized", expanded once into a plain
    nn.Linear (the same numbers, 4x the weight memory, the platform's dense matmul).
    `dtype`: of the plain tensors on that path (default: bf16 on a GPU, the checkpoint's own
    on a CPU). `served`: the CPU runner's fused kernels will serve the model (the server, not
    an evaluation that runs the model's own forward): a 4-bit checkpoint whose projections
    they fuse is read by model/gptq.py too, GPTQ's tensors as stored (the runner repacks them
    in any case), without importing gptqmodel and optimum or their rewrite of every layer.
    """
    if kernel not in KERNELS:
        raise CheckpointError(f"unknown kernel {kernel!r} (choose one of {', '.join(KERNELS)})")
    quant = check_checkpoint(path)
    torch.set_num_threads(threads)
    target = pick_device(device)
    if target.type == "cuda" and kernel not in ("auto", "dequantized"):
        raise CheckpointError(
            f"kernel {kernel} is a CPU kernel: on a GPU the runner measures its own (auto)"
        )
    if target.type == "cuda":
        model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
        check_family(str(model_type), GPU_MODEL_TYPES, " on a GPU")
    if target.type == "cpu" and kernel == "auto" and int(quant.get("bits", 4)) == 8:
        # no CPU kernel serves 8-bit codes fast (gptqmodel's ran far slower than the weights
        # expanded, load/bench_layouts.py): expanded once to bf16, which the runner prepacks for
        # oneDNN (twice the 8-bit weights' memory)
        log.info("8-bit GPTQ on a CPU: weights dequantized to bf16 at load")
        kernel = "dequantized"
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        own_reader = target.type == "cuda" or kernel == "dequantized"
        if own_reader or (served and _fused_by_runner(path, quant, kernel)):
            if dtype is None:  # on a CPU fp16 too becomes bf16, as on gptqmodel's path
                stored = _checkpoint_dtype(path)
                cpu_dtype = torch.bfloat16 if stored == torch.float16 else stored
                dtype = torch.bfloat16 if target.type == "cuda" else cpu_dtype
            model = load_gptq_model(path, quant, target, dtype)
            head = model.get_output_embeddings()
            if isinstance(head, GPTQLinear):  # a quantized head: served expanded, as on a CPU
                model.set_output_embeddings(dense_linear(head, dtype))
        else:
            model = _load_with_gptqmodel(path, quant, target, kernel)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{path} could not be loaded as a GPTQ model with kernel {kernel}: {exc}"
        ) from exc
    model.eval()
    name = _kernel_name(model)
    if kernel == "dequantized":
        dequantize_linears(model)
        name = "Linear (dequantized)"
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=target,
        eos_ids=_eos_ids(model, tokenizer),
        pad_token_id=_pad_id(tokenizer),
        context_length=context_length(model.config),
        kernel=name,
    )


def _load_with_gptqmodel(
    path: Path, quant: dict[str, Any], target: torch.device, kernel: str
) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM, GPTQConfig

    config = AutoConfig.from_pretrained(path)
    if getattr(config, "quantization_config", None) is None:  # AutoGPTQ's quantize_config.json
        config.quantization_config = quant
    backend = None if kernel == "auto" else kernel
    if kernel in FUSED_KERNELS:  # the runner's fused kernels start from TorchAtenLinear's weights
        backend = "gptq_torch_aten"
    options: dict[str, Any] = {}
    if backend is not None:  # only the backend is taken from here; the rest from config.json
        options["quantization_config"] = GPTQConfig(bits=int(quant["bits"]), backend=backend)
    if target.type == "cpu" and _checkpoint_dtype(path) == torch.float16:
        # fp16's other tensors (embeddings, norms, head) in bf16, converted once here: the
        # runner's native attention and layer kernels take bf16, and a CPU has no fp16
        # arithmetic faster than bf16's (vLLM's CPU backend casts fp16 to bf16 too)
        options["dtype"] = torch.bfloat16
    model: Any = AutoModelForCausalLM.from_pretrained(
        path, config=config, device_map=str(target), **options
    )
    if quant.get("lm_head"):
        # transformers loads a GPTQ head as a plain Linear of random weights (its packed
        # tensors "unexpected"): the head is expanded here from them, once, as the runner
        # serves a head (bf16, or its own int8) in any case
        dtype = model.get_input_embeddings().weight.dtype
        layout = GPTQLayout.from_config(quant)
        head = gptq_linear(read_module(path, "lm_head", target), layout, "lm_head")
        model.set_output_embeddings(dense_linear(head, dtype))
    return model


def _fused_by_runner(path: Path, quant: dict[str, Any], kernel: str) -> bool:
    """The CPU runner's fused kernels serve every projection of this checkpoint from GPTQ's
    tensors as stored (engine/runners/internals.py `aten_packed`): 4 bits in the groups that
    gptqmodel's TorchAtenLinear takes (the layouts the runner fuses either way), a kernel of
    its own (or auto), and no bias on an output projection (the model's own modules serve
    those: gptqmodel's)."""
    config = json.loads((path / "config.json").read_text())
    biased = bool(config.get("attention_bias")) or bool(config.get("mlp_bias"))
    own = kernel == "auto" or kernel in FUSED_KERNELS
    grouped = int(quant.get("group_size", 128)) in ATEN_GROUPS
    return own and int(quant.get("bits", 4)) == 4 and grouped and not biased


def _checkpoint_dtype(path: Path) -> torch.dtype:
    """The dtype config.json names for the plain tensors (bf16 where it names none)."""
    config = json.loads((path / "config.json").read_text())
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    found = getattr(torch, name.removeprefix("torch."), None)
    return found if isinstance(found, torch.dtype) else torch.bfloat16


@torch.no_grad()
def dequantize_linears(model: Any) -> None:
    """Replace every GPTQLinear by an nn.Linear holding its dequantized weight, in place.

    Each Linear is made on the meta device and given its weight: no random initialisation of
    weights that are overwritten at once (a third of the expansion's time)."""
    dtype = model.get_input_embeddings().weight.dtype
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, GPTQLinear):
                setattr(parent, name, dense_linear(child, dtype))


@torch.no_grad()
def dense_linear(child: GPTQLinear, dtype: torch.dtype) -> torch.nn.Linear:
    """An nn.Linear holding `child`'s dequantized weight in `dtype`."""
    linear = torch.nn.Linear(
        child.in_features,
        child.out_features,
        bias=child.bias is not None,
        device="meta",
        dtype=dtype,
    )
    stored = child.dequantized()  # [K, N], rows in stored order
    weight = torch.empty_like(stored)
    if child.perm is None:
        weight = stored
    else:  # stored row k multiplies input perm[k]
        weight[child.perm] = stored
    linear.weight = torch.nn.Parameter(weight.t().to(dtype), requires_grad=False)
    if child.bias is not None:
        bias = child.bias.to(dtype=dtype, copy=True)
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    return linear.eval()


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
        if type(module).__module__.startswith("gptqmodel") or isinstance(module, GPTQLinear):
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
