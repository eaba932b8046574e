"""What makes a settings field a flag: `option` (its default, its --help line, its choices), and
the named choices flags take, which the engine and the loader read too."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import Any, TypeVar

T = TypeVar("T")

# GPTQ kernels the loader can use (--loader-kernel): gptqmodel's own choice, the CPU kernels
# gptqmodel offers (as its backend names) and the weights dequantized at load into plain Linear
# layers. Not offered:
# gptq_torch_fused (gptqmodel 7.6.0), whose logits on an asymmetric checkpoint (the default
# recipe) are off by up to 33 against TorchAtenLinear and the dequantized weights (checked here).
# Then the kernels of the runner's fused projections (--kernel): "auto" lets
# the autotune choose per row count; a name from FUSED_KERNELS forces that one: torch's int4 op,
# the weights expanded to bf16 and prepacked for oneDNN, or int4_matmul.c with fp32 or int8
# activations (the widest instruction set, or the one named; engine/runners/native/bindings.py).
LOADER_KERNELS = ("auto", "gptq_torch_aten", "gptq_torch", "gptq_torch_int8", "dequantized")
# auto, but not the kernel a checkpoint's build recorded for it (quality.json's `serve`)
AUTOTUNE = "autotune"
NATIVE_ISAS = ("avx512vnni", "avx512", "avx2vnni", "avx2")  # widest first
NATIVE_KERNELS = tuple(
    f"native_{act}{isa}" for act in ("f32", "i8") for isa in ("", *(f"_{i}" for i in NATIVE_ISAS))
)
FUSED_KERNELS = ("int4_op", "prepacked_bf16", *NATIVE_KERNELS)
RUNNER_KERNELS = ("auto", AUTOTUNE, *FUSED_KERNELS)  # --kernel: the runner's matmuls
KERNELS = (*LOADER_KERNELS, AUTOTUNE, *FUSED_KERNELS)  # load_checkpoint's `kernel`: either
# how decode rows attend: on a CPU native (runners/native/bindings.py) or torch; on a GPU triton
# (engine/runners/cuda/triton_ops.py) or torch; auto: native on a CPU, measured on a GPU
ATTENTION = ("auto", "native", "torch", "triton")
SPECULATIVE = ("off", "ngram", "suffix")  # --speculative (engine/speculation.py)
HASH_ALGOS = ("sha256", "sha256_cbor", "builtin")  # --prefix-caching-hash-algo, vLLM's names
# --tool-call-parser: engine/tool_formats/'s names (vLLM's), then the aliases it takes; ""
# (the default): the one the chat template asks for
TOOL_CALL_PARSERS = (
    "",
    "hermes",
    "llama3_json",
    "mistral",
    "phi4_mini_json",
    "pythonic",
    "qwen",
    "qwen3_xml",
    "llama4_json",
    "phi4_mini",
)
REASONING_PARSERS = ("qwen3", "deepseek_r1", "none")  # --reasoning-parser (engine/reasoning.py)
OTLP_PROTOCOLS = ("grpc", "http/protobuf")
PAYLOAD_MODES = ("off", "hash", "full")


def option(default: T, help: str, choices: Sequence[str] | None = None) -> T:
    """A settings field that is a flag: `--NAME` (its name's dashes) and `PREDICTOR_NAME`, with
    this default, this --help line and, where given, only these values (settings.build_parser)."""
    metadata: dict[str, Any] = {"help": help, "choices": choices}
    return field(default=default, metadata=metadata)
