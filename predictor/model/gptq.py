"""GPTQ checkpoints read with torch and safetensors alone: the GPU path's loader.

gptqmodel's GPU kernels are compiled extensions (Marlin, ExLlama) built when it is installed; the
GPU runner brings its own (engine/runners/cuda/), so on a GPU the checkpoint is read here, as
vLLM reads it: the model's skeleton from its config on the meta device, every plain tensor
assigned, and each GPTQ Linear (`qweight`, `qzeros`, `scales`, `g_idx`, `bias`) replaced by a
`GPTQLinear` holding its tensors. Its own forward dequantizes and multiplies (exact, slow): it
serves transformers' forward (the tests' reference); the runner reads its tensors and runs its own
kernels.

The packing (gptqmodel's and AutoGPTQ's GPTQ format): qweight [K * bits / 32, N] int32 holds
input row k's code at bits * (k % (32 / bits)) of word k // (32 / bits); qzeros [groups, N * bits /
32] the same along columns; scales [groups, N]; g_idx [K] the group of each input row. The
checkpoint format `gptq` (v1) stores each zero point minus one, `gptq_v2` as it is.

Act-order (desc_act) checkpoints quantize the inputs in another order, so a group's rows are
scattered: the rows are reordered once here so every group is contiguous (as ExLlama does), and
`perm` says which input feeds each row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from predictor.errors import CheckpointError
from predictor.packing import dequantize, pack_rows, shift_zero_fields, unpack_columns, unpack_rows

SUPPORTED_BITS = (4, 8)
FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class GPTQLayout:
    """What a checkpoint's quantization config says about its packed tensors."""

    bits: int
    group_size: int  # -1: one group per output column (per-channel)
    sym: bool
    desc_act: bool
    zeros_minus_one: bool  # the v1 format stores each zero point minus one

    @classmethod
    def from_config(cls, quant: dict[str, Any]) -> GPTQLayout:
        """The layout of a `quantization_config`, or CheckpointError naming what is not served."""
        bits = int(quant.get("bits", 4))
        if bits not in SUPPORTED_BITS:
            raise CheckpointError(
                f"GPTQ with {bits} bits is not served (supported: "
                f"{', '.join(map(str, SUPPORTED_BITS))} bits)"
            )
        form = str(quant.get("checkpoint_format") or quant.get("format") or "gptq").lower()
        if form not in FORMATS:
            raise CheckpointError(
                f"GPTQ checkpoint format {form!r} is not served (supported: {', '.join(FORMATS)})"
            )
        return cls(
            bits=bits,
            group_size=int(quant.get("group_size", 128)),
            sym=bool(quant.get("sym", True)),
            desc_act=bool(quant.get("desc_act", False)),
            zeros_minus_one=form == "gptq",
        )


class GPTQLinear(torch.nn.Module):
    """A GPTQ Linear's tensors, unpacked where the kernels want them so, groups contiguous.

    qweight [K * bits / 32, N] int32 (rows in `perm` order when act-order reordered them),
    zeros [G, N] int32 (the real zero points), scales [G, N] (as stored: fp16 mostly), bias [N]
    or None, perm [K] int64 or None: row k of the weights multiplies input perm[k].
    The forward dequantizes the whole weight each call: for references, not for serving."""

    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    perm: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        qweight: torch.Tensor,
        zeros: torch.Tensor,
        scales: torch.Tensor,
        perm: torch.Tensor | None,
        bias: torch.Tensor | None,
        bits: int,
        group_size: int,
        in_features: int,
    ) -> None:
        super().__init__()
        self.bits, self.group_size = bits, group_size
        self.in_features, self.out_features = in_features, int(scales.shape[1])
        self.register_buffer("qweight", qweight)
        self.register_buffer("zeros", zeros)
        self.register_buffer("scales", scales)
        self.register_buffer("perm", perm)
        self.register_buffer("bias", bias)

    def codes(self) -> torch.Tensor:
        """[K, N] int32, in the stored row order."""
        return unpack_rows(self.qweight, self.bits, self.in_features)

    def group_index(self) -> torch.Tensor:
        """The group of each stored row: [K] (contiguous groups of group_size)."""
        rows = torch.arange(self.in_features, device=self.qweight.device)
        return rows // self.group_size

    def dequantized(self) -> torch.Tensor:
        """The weight [K, N] float32, rows in stored order."""
        return dequantize(self.codes(), self.zeros, self.scales, self.group_index())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        out = torch.matmul(x, self.dequantized().to(x.dtype))
        return out if self.bias is None else out + self.bias.to(x.dtype)


def gptq_linear(tensors: dict[str, torch.Tensor], layout: GPTQLayout, name: str) -> GPTQLinear:
    """The GPTQLinear of one checkpoint module from its packed tensors (on their device)."""
    try:
        qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    except KeyError as missing:
        raise CheckpointError(f"{name}: the GPTQ tensor {missing} is missing") from None
    bits, columns = layout.bits, int(scales.shape[1])
    rows = int(qweight.shape[0]) * 32 // bits
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise CheckpointError(
            f"{name}: GPTQ tensors packed as int32 are served, not {qweight.dtype}"
        )
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        rows = int(g_idx.shape[0])
    group = layout.group_size if layout.group_size > 0 else rows
    if rows % group or int(scales.shape[0]) != rows // group:
        raise CheckpointError(
            f"{name}: {scales.shape[0]} groups of scales for {rows} inputs in groups of {group}"
        )
    if layout.zeros_minus_one:
        qzeros = shift_zero_fields(qzeros, bits, 1)
    zeros = unpack_columns(qzeros, bits, columns)
    perm = None
    if g_idx is not None:
        g_idx = g_idx.long()
        order = torch.argsort(g_idx, stable=True)
        expected = torch.arange(rows, device=g_idx.device) // group
        if not torch.equal(g_idx[order], expected):
            raise CheckpointError(f"{name}: its g_idx does not split the inputs into equal groups")
        if not torch.equal(order, torch.arange(rows, device=order.device)):
            codes = unpack_rows(qweight, bits, rows).index_select(0, order)
            qweight, perm = pack_rows(codes, bits), order
    return GPTQLinear(
        qweight, zeros.to(torch.int32), scales, perm, tensors.get("bias"), bits, group, rows
    )


def read_tensors(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files (sharded or not), on `device`."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / name for name in names]
    if not files:
        raise CheckpointError(f"{path} has no safetensors files (the GPU path reads only those)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as opened:
            for key in opened.keys():  # noqa: SIM118 (safe_open is no dict)
                tensors[key] = opened.get_tensor(key)
    return tensors


def read_module(path: Path, prefix: str, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of one module (`prefix`.qweight, ...) by field, read from the shard(s) that
    hold them and nothing else."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [
            path / n
            for n in sorted({f for k, f in weight_map.items() if k.startswith(prefix + ".")})
        ]
    parts: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as opened:
            for key in opened.keys():  # noqa: SIM118 (safe_open is no dict)
                if key.startswith(prefix + "."):
                    parts[key[len(prefix) + 1 :]] = opened.get_tensor(key)
    return parts


def load_gptq_model(
    path: Path, quant: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> Any:
    """The checkpoint as a transformers causal LM on `device`: plain tensors in `dtype`, each
    GPTQ Linear a GPTQLinear. CheckpointError naming what is missing or not served."""
    from transformers import AutoConfig, AutoModelForCausalLM

    layout = GPTQLayout.from_config(quant)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = read_tensors(path, device)
    prefixes = sorted({key[: -len(".qweight")] for key in tensors if key.endswith(".qweight")})
    if not prefixes:
        raise CheckpointError(f"{path}: no GPTQ tensors (qweight) in its weight files")
    for prefix in prefixes:
        parts = {}
        for field in ("qweight", "qzeros", "scales", "g_idx", "bias"):
            key = f"{prefix}.{field}"
            if key in tensors:
                parts[field] = tensors.pop(key)
        if "bias" in parts:
            parts["bias"] = parts["bias"].to(dtype)
        try:
            model.get_submodule(prefix)
        except AttributeError:
            raise CheckpointError(
                f"{path}: {prefix} is not a module of {config.model_type}"
            ) from None
        model.set_submodule(prefix, gptq_linear(parts, layout, prefix))
    plain = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(plain, strict=False, assign=True)
    if unexpected:
        raise CheckpointError(f"{path}: tensors the model has no place for: {unexpected[:5]}")
    if getattr(config, "tie_word_embeddings", False) or getattr(
        config.get_text_config(), "tie_word_embeddings", False
    ):
        model.tie_weights()
    _rebuild_rotary(model, config, device)
    if (path / "generation_config.json").is_file():  # its EOS ids, as from_pretrained reads them
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"{path}: tensors missing from its weight files: {left[:5]}")
    return model.eval()


def _rebuild_rotary(model: Any, config: Any, device: torch.device) -> None:
    """Rotary tables (and Gemma's embedding scale) are buffers computed at construction, not
    stored: made again on `device` (the skeleton was built on the meta device)."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding") and any(
            b.is_meta for b in module.buffers()
        ):
            with torch.device(device):  # the tables are made where they are used
                model.set_submodule(name, type(module)(config=config))
        scale = getattr(module, "scalar_embed_scale", None)  # Gemma's embeddings * sqrt(hidden)
        if scale is not None and module.embed_scale.is_meta:
            module.embed_scale = torch.tensor(float(scale), device=device)
