"""Random-weight GPTQ checkpoints of a named shape, written directly (no quantization run).

Every quantized Linear gets random codes, zero points and scales in the layout asked for (bits,
group size, sym or asym, act-order, the v1 or v2 checkpoint format); the other tensors are random
too (embeddings wide enough that greedy tokens rarely tie). A 1.7B-parameter checkpoint takes
seconds on a GPU, so the device script builds the model it benchmarks on the spot, and the
tests build one per layout. The speed of a model depends on its shape, not its weights.

    python -m load.random_gptq --shape smollm2-1.7b --tokenizer DIR --out DIR [--device cuda]
        [--family llama|mistral|qwen2|qwen3|phi3|gemma2|gemma3_text]

A family changes what transformers' config and tensors hold beyond Llama's: Qwen2's biased q, k
and v projections, Qwen3's per-head q and k RMSNorms, Mistral's sliding window (`--window`),
Phi-3's q, k, v and gate, up stored as one Linear each, Gemma 2's four norms a layer (weights
stored as offsets from 1), GELU and soft-capped attention scores and logits, Gemma 3's q and k
norms, local and global rotary bases and sliding layers (every other one here).
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from predictor.packing import pack_columns, pack_rows, shift_zero_fields

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class Shape:
    """A Llama-family decoder's dimensions (config.json's names)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int = 49152
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True


SHAPES = {
    # untied: a random tied head favours the token just read, and greedy text repeats it
    "tiny": Shape(128, 256, 2, 4, 2, 32, max_position_embeddings=1024, tie_word_embeddings=False),
    # the default model's (SmolLM2-135M-Instruct) and its 1.7B sibling's
    "smollm2-135m": Shape(576, 1536, 30, 9, 3, 64),
    "smollm2-1.7b": Shape(2048, 8192, 24, 32, 32, 64, rope_theta=130000.0),
    # the shapes of Llama-3.2-1B, Qwen2.5-1.5B and Llama-3.2-3B (as Llama-family decoders: the
    # speed is the shape's; tied heads over their own vocabularies)
    "llama-3.2-1b": Shape(2048, 8192, 16, 32, 8, 64, vocab_size=128256, rope_theta=500000.0),
    "qwen2.5-1.5b": Shape(1536, 8960, 28, 12, 2, 128, vocab_size=151936, rope_theta=1000000.0),
    "llama-3.2-3b": Shape(3072, 8192, 28, 24, 8, 128, vocab_size=128256, rope_theta=500000.0),
}


@dataclass(frozen=True)
class Layout:
    """How the quantized Linears are stored (config.json's quantization_config)."""

    bits: int = 4
    group_size: int = 32
    sym: bool = False
    desc_act: bool = False
    checkpoint_format: str = "gptq"  # or gptq_v2
    dtype: torch.dtype = torch.bfloat16  # of every other tensor
    quantize_config_file: bool = False  # AutoGPTQ's quantize_config.json, not in config.json
    shards: int = 1  # safetensors files, with an index where more than one
    lm_head: bool = False  # the head GPTQ-quantized too (untied shapes only)


# model_type -> (architecture, the config keys that differ from Llama's)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {"attention_bias": False, "mlp_bias": False}),
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": None}),
    "qwen3": ("Qwen3ForCausalLM", {"attention_bias": False, "use_sliding_window": False,
                                   "sliding_window": None}),
    "phi3": ("Phi3ForCausalLM", {"sliding_window": None, "resid_pdrop": 0.0,
                                 "embd_pdrop": 0.0, "attention_dropout": 0.0}),
    "gemma2": ("Gemma2ForCausalLM", {"hidden_act": "gelu_pytorch_tanh",
                                     "hidden_activation": "gelu_pytorch_tanh",
                                     "attn_logit_softcapping": 50.0,
                                     "final_logit_softcapping": 30.0, "sliding_window": 4096,
                                     "rms_norm_eps": 1e-6}),
    "gemma3_text": ("Gemma3ForCausalLM", {"hidden_act": "gelu_pytorch_tanh",
                                          "hidden_activation": "gelu_pytorch_tanh",
                                          "attn_logit_softcapping": None,
                                          "final_logit_softcapping": None, "sliding_window": 512,
                                          "sliding_window_pattern": 2, "rms_norm_eps": 1e-6}),
}  # fmt: skip
GEMMA = ("gemma2", "gemma3_text")  # norms stored as offsets from 1, four a layer
# Phi-3's stored-fused projections, in place of PROJECTIONS' q, k, v and gate, up
FUSED_PROJECTIONS = (
    ("self_attn.qkv_proj", "hidden", "qkv"),
    ("self_attn.o_proj", "q", "hidden"),
    ("mlp.gate_up_proj", "hidden", "gate_up"),
    ("mlp.down_proj", "intermediate", "hidden"),
)

PROJECTIONS = (
    ("self_attn.q_proj", "hidden", "q"),
    ("self_attn.k_proj", "hidden", "kv"),
    ("self_attn.v_proj", "hidden", "kv"),
    ("self_attn.o_proj", "q", "hidden"),
    ("mlp.gate_proj", "hidden", "intermediate"),
    ("mlp.up_proj", "hidden", "intermediate"),
    ("mlp.down_proj", "intermediate", "hidden"),
)


def quantized_linear(
    rows: int,
    columns: int,
    layout: Layout,
    generator: torch.Generator,
    device: torch.device,
    order: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """One GPTQ Linear (K = rows inputs, N = columns outputs): qweight, qzeros, scales, g_idx.
    `order`: act-order's quantization order of the inputs (Linears reading the same input share
    their Hessian's, so their order), random where not given.

    Weights of standard deviation about 1 / sqrt(K): each layer moves the residual stream as
    much as it holds (at transformers' 0.02 a random model only repeats its input token, its
    tied head's largest logit). Codes uniform, each group's scale varied by up to 50%."""
    bits, levels = layout.bits, 1 << layout.bits
    group = layout.group_size if layout.group_size > 0 else rows
    groups = rows // group

    def uniform(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=generator, device=device)

    codes = (uniform(rows, columns) * levels).long().clamp_(0, levels - 1)
    if layout.sym:
        zeros = torch.full((groups, columns), levels // 2, dtype=torch.long, device=device)
    else:
        zeros = (levels // 2 + (uniform(groups, columns) - 0.5) * levels / 4).round().long()
    spread = levels / 12**0.5
    scales = (rows**-0.5 / spread) * (0.5 + uniform(groups, columns))
    g_idx = torch.arange(rows, device=device) // group
    if layout.desc_act:  # input k is quantized at position order[k]: groups scattered
        if order is None:
            order = torch.randperm(rows, generator=generator, device=device)
        g_idx = order // group
    stored = pack_columns(zeros, bits)  # [groups, N * bits / 32]
    if layout.checkpoint_format == "gptq":  # v1: every field stored minus one
        stored = shift_zero_fields(stored, bits, -1)
    return {
        "qweight": pack_rows(codes, bits),
        "qzeros": stored,
        "scales": scales.to(torch.float16),
        "g_idx": g_idx.to(torch.int32),
    }


def config_dict(
    shape: Shape,
    layout: Layout,
    bos: int,
    eos: int,
    family: str = "llama",
    window: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """config.json's contents; `overrides` replace its keys last (rope scaling, caps)."""
    architecture, extra = FAMILIES[family]
    if window is not None:
        extra = {**extra, "sliding_window": window}
        if family.startswith("qwen"):  # their window applies only with this flag
            extra["use_sliding_window"] = True
    return {
        "architectures": [architecture],
        "model_type": family,
        "hidden_act": "silu",
        **extra,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": extra.get("rms_norm_eps", 1e-5),
        "rope_parameters": _rope_parameters(shape, family),
        "tie_word_embeddings": shape.tie_word_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "dtype": str(layout.dtype).removeprefix("torch."),
        "quantization_config": quantization_config(layout),
        **(overrides or {}),
    }


def _rope_parameters(shape: Shape, family: str) -> dict[str, Any]:
    default = {"rope_theta": shape.rope_theta, "rope_type": "default"}
    if family != "gemma3_text":
        return default
    local = {"rope_theta": 10000.0, "rope_type": "default"}  # Gemma 3's sliding layers' base
    return {"sliding_attention": local, "full_attention": default}


def quantization_config(layout: Layout) -> dict[str, Any]:
    return {
        "quant_method": "gptq",
        "bits": layout.bits,
        "group_size": layout.group_size,
        "sym": layout.sym,
        "desc_act": layout.desc_act,
        "checkpoint_format": layout.checkpoint_format,
        "pack_dtype": "int32",
        "lm_head": layout.lm_head,
    }


def quantize_config_json(layout: Layout) -> dict[str, Any]:
    """AutoGPTQ's quantize_config.json (TheBloke's checkpoints): no quant_method, v1 format."""
    assert layout.checkpoint_format == "gptq", "AutoGPTQ wrote the v1 format only"
    return {"bits": layout.bits, "group_size": layout.group_size, "damp_percent": 0.01,
            "desc_act": layout.desc_act, "sym": layout.sym, "true_sequential": True,
            "model_name_or_path": None, "model_file_base_name": "model"}  # fmt: skip


def write_checkpoint(
    out: Path,
    shape: Shape,
    layout: Layout,
    tokenizer_dir: Path,
    seed: int = 0,
    device: torch.device | str = "cpu",
    family: str = "llama",
    window: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """A random GPTQ checkpoint of `shape` in `layout` at `out`, with the tokenizer of
    `tokenizer_dir` (its files copied; vocab_size need not match it), of a family of FAMILIES
    (`window`: a sliding window, where the family has one)."""
    device = torch.device(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    dims = {
        "hidden": shape.hidden_size,
        "q": shape.num_attention_heads * shape.head_dim,
        "kv": shape.num_key_value_heads * shape.head_dim,
        "intermediate": shape.intermediate_size,
    }
    dims["qkv"] = dims["q"] + 2 * dims["kv"]
    dims["gate_up"] = 2 * dims["intermediate"]
    projections = FUSED_PROJECTIONS if family == "phi3" else PROJECTIONS
    norms = ["input_layernorm", "post_attention_layernorm"]
    if family in GEMMA:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    tokenizer = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    bos, eos = _special_ids(tokenizer_dir, tokenizer)
    tensors: dict[str, torch.Tensor] = {}
    embed = torch.randn((shape.vocab_size, shape.hidden_size), generator=generator, device=device)
    embed *= 0.5  # a wide logit spread (tied head): few near-ties between the top tokens
    embed[eos] = 0.0  # logit 0 for the end of sequence, far below the top: streams run long
    tensors["model.embed_tokens.weight"] = embed.to(layout.dtype)
    if not shape.tie_word_embeddings:
        head = torch.randn(embed.shape, generator=generator, device=device) * 0.5
        head[eos] = 0.0
        tensors["lm_head.weight"] = head.to(layout.dtype)
    if layout.lm_head:  # codes of random weights: the head's own values are not kept
        assert not shape.tie_word_embeddings, "a quantized head is an untied one"
        del tensors["lm_head.weight"]
        head_parts = quantized_linear(shape.hidden_size, shape.vocab_size, layout, generator,
                                      device)  # fmt: skip
        for field, tensor in head_parts.items():
            tensors[f"lm_head.{field}"] = tensor

    def norm(
        size: int = shape.hidden_size,
    ) -> torch.Tensor:  # Gemma's scale by 1 + weight: random offsets, the others 1
        if family not in GEMMA:
            return torch.ones(size, dtype=layout.dtype, device=device)
        offsets = torch.rand(size, generator=generator, device=device) - 0.5
        return offsets.to(layout.dtype)

    tensors["model.norm.weight"] = norm()
    for index in range(shape.num_hidden_layers):
        prefix = f"model.layers.{index}"
        for name in norms:
            tensors[f"{prefix}.{name}.weight"] = norm()
        orders = {  # one act-order order per input the projections read
            rows: torch.randperm(dims[rows], generator=generator, device=device)
            for _, rows, _ in projections
        }
        for name, rows, columns in projections:
            parts = quantized_linear(dims[rows], dims[columns], layout, generator, device,
                                     orders[rows])  # fmt: skip
            for field, tensor in parts.items():
                tensors[f"{prefix}.{name}.{field}"] = tensor
        if family == "qwen2":  # q, k and v carry a bias, stored beside the packed weights
            for name, _, columns in PROJECTIONS[:3]:
                bias = torch.randn(dims[columns], generator=generator, device=device) * 0.5
                tensors[f"{prefix}.{name}.bias"] = bias.to(layout.dtype)
        if family == "qwen3":  # each head's query and key RMS-normed before rotary
            for name in ("q_norm", "k_norm"):
                weight = 0.5 + torch.rand(shape.head_dim, generator=generator, device=device)
                tensors[f"{prefix}.self_attn.{name}.weight"] = weight.to(layout.dtype)
        if family == "gemma3_text":  # the same, Gemma's offsets from 1
            for name in ("q_norm", "k_norm"):
                tensors[f"{prefix}.self_attn.{name}.weight"] = norm(shape.head_dim)
    _save(out, {k: v.contiguous().cpu() for k, v in tensors.items()}, layout.shards)
    config = config_dict(shape, layout, bos, eos, family, window, overrides)
    if layout.quantize_config_file:
        del config["quantization_config"]
        (out / "quantize_config.json").write_text(json.dumps(quantize_config_json(layout)))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos})
    )
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)
    return out


def _save(out: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """One model.safetensors, or `shards` files and the index transformers reads them by."""
    from safetensors.torch import save_file

    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for index in range(shards):
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[index::shards]}
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


def _special_ids(tokenizer_dir: Path, tokenizer_config: dict[str, Any]) -> tuple[int, int]:
    """The bos and eos ids of a tokenizer folder, read from tokenizer.json's added tokens."""
    added = json.loads((tokenizer_dir / "tokenizer.json").read_text()).get("added_tokens", [])
    ids = {token["content"]: int(token["id"]) for token in added}

    def find(key: str, fallback: int) -> int:
        value = tokenizer_config.get(key)
        content = value.get("content") if isinstance(value, dict) else value
        return ids.get(str(content), fallback)

    return find("bos_token", 1), find("eos_token", 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--sym", action="store_true")
    parser.add_argument("--desc-act", action="store_true")
    parser.add_argument("--format", default="gptq", choices=("gptq", "gptq_v2"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    parser.add_argument("--window", type=int, default=None, help="a sliding window, in tokens")
    args = parser.parse_args()
    layout = replace(
        Layout(), bits=args.bits, group_size=args.group_size, sym=args.sym,
        desc_act=args.desc_act, checkpoint_format=args.format,
    )  # fmt: skip
    write_checkpoint(args.out, SHAPES[args.shape], layout, args.tokenizer, args.seed, args.device,
                     args.family, args.window)  # fmt: skip
    print(args.out)


if __name__ == "__main__":
    main()
