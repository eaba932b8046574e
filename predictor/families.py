"""The decoder families this server serves, by config.json's `model_type`, and the one check
that refuses another: the loader (before any weight is read), the quantizer's `--source`
checks, the CPU runner (engine/runners/family.py) and the GPU runner all read these lists
(a leaf: no torch, importable from every layer)."""

from __future__ import annotations

from collections.abc import Sequence

from predictor.errors import UnsupportedModel

# the CPU runner's families (engine/runners/cpu.py, what differs: engine/runners/family.py)
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
# the GPU runner's (engine/runners/cuda/runner.py)
GPU_MODEL_TYPES = ("llama",)
# sliding windows: these families' (where config.json sets one) cap the context at the window,
# so no key a query may see is ever outside it (model/loader.py); these attend through theirs,
# layer by layer, with a window mask (Gemma 3: 512-token windows on 5 layers of 6, the context
# 32k; engine/runners/family.py)
CONTEXT_WINDOWED = ("mistral", "phi3", "gemma2")
WINDOW_MASKED = ("gemma3_text",)


def check_family(model_type: str, supported: Sequence[str] = MODEL_TYPES, where: str = "") -> None:
    """UnsupportedModel unless `model_type` is one of `supported`; `where` says for what (" on a
    GPU"), and the message lists the families that are."""
    if model_type not in supported:
        raise UnsupportedModel(
            f"model type {model_type!r} is not supported{where} (supported: {', '.join(supported)})"
        )
