"""A GGUF file as `quantize --source`: its metadata checked in a moment (architecture, widths,
tokenizer, chat template) before any weight is read, then dequantized into a bf16 transformers
checkpoint (transformers' GGUF loader: what `save_pretrained` alone refuses, "quantized with
gguf and is not serializable") that the build quantizes and scores against.

Most small models people have on disk are GGUFs (llama.cpp's, Ollama's); the GPTQ build needs
fp weights, so a GGUF's own quantization (Q4_K, Q8_0, ...) is the reference the build is scored
against, not the original fp16 model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from predictor.families import MODEL_TYPES

# GGUF's general.architecture -> the transformers model_type it loads as (Mistral's GGUFs say
# "llama"; Gemma 3's text models load as gemma3_text)
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
}
MAGIC = b"GGUF"


@dataclass(frozen=True)
class GgufSource:
    path: Path
    model_type: str
    hidden_size: int
    intermediate_size: int
    chat_template: bool
    file_type: str  # what its weights are stored as, e.g. "Q4_K" (of its first matrix)


def is_gguf(path: Path) -> bool:
    """A file that starts as a GGUF does (a folder is a transformers checkpoint)."""
    try:
        with path.open("rb") as handle:
            return path.is_file() and handle.read(4) == MAGIC
    except OSError:
        return False


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_gguf(path: Path) -> GgufSource:
    """The GGUF's metadata (the `gguf` package maps the file; no tensor is read), or
    SystemExit naming why it cannot be a source."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--source {path}: not a readable GGUF file ({exc})") from exc
    arch = str(_field(reader, "general.architecture") or "")
    model_type = ARCHITECTURES.get(arch, arch)
    if model_type not in MODEL_TYPES:
        served = ", ".join(sorted(a for a, t in ARCHITECTURES.items() if t in MODEL_TYPES))
        raise SystemExit(
            f"--source {path}: GGUF architecture {arch!r} is not served (supported: {served})"
        )
    if _field(reader, "tokenizer.ggml.model") is None:
        raise SystemExit(f"--source {path} has no tokenizer (no tokenizer.ggml.* metadata)")
    hidden = _field(reader, f"{arch}.embedding_length")
    inner = _field(reader, f"{arch}.feed_forward_length")
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    return GgufSource(
        path=path,
        model_type=model_type,
        hidden_size=int(hidden or 0),
        intermediate_size=int(inner or 0),
        chat_template=bool(_field(reader, "tokenizer.chat_template")),
        file_type=matrices[0].tensor_type.name if matrices else "?",
    )


def export_gguf(path: Path, out: Path) -> None:
    """The GGUF's weights dequantized into a bf16 transformers checkpoint at `out`, with its
    tokenizer and chat template (from the GGUF's metadata)."""
    from predictor.model.source import export_gguf_to_fp32

    export_gguf_to_fp32(path.parent, path.name, out, dtype="bfloat16")
