"""The dtype of the calibration forwards, measured on this CPU, and the dtype a checkpoint keeps.

gptqmodel (7.6.0) loads a model to quantize on a CPU in bfloat16 whatever the checkpoint holds
(its `auto_dtype`), so every calibration forward and replay multiplies in bf16. That is the fast
choice where the CPU has bf16 dot products (AVX-512-BF16, AMX), and a slow one where it has
not: oneDNN then emulates bf16, and with torch held to AVX2 the forwards took most of the GPTQ
phase (load/RESULTS.md, "make model profile"). `calibration_dtype` times one MLP-sized
matmul in each dtype and takes bf16 only when it is clearly faster, since fp32 is exact.

Whatever the forwards ran in, `keep_unquantized_in` stores the weights GPTQ leaves alone
(embeddings, norms, an untied head) in one dtype, bf16, so the checkpoint the server loads has
the same layout and size on every machine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CHOICES = ("auto", "bfloat16", "float32")
STORED_DTYPE = "bfloat16"  # the unquantized weights of every checkpoint make model writes
# bf16 must beat fp32 by this factor to be chosen: fp32 is exact, and a noisy timing on a
# machine where the two are close should not trade exactness for nothing.
BF16_MARGIN = 1.2
ROWS = 256  # tokens in a timed matmul: a calibration batch's order of magnitude
REPEATS = 5


def matmul_seconds(dtype: torch.dtype, inner: int, outer: int, repeats: int = REPEATS) -> float:
    """The best of `repeats` timings of a [ROWS, inner] x [inner, outer] Linear in `dtype`."""
    import torch

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, inner, generator=generator).to(dtype)
    weight = torch.randn(outer, inner, generator=generator).to(dtype)
    with torch.inference_mode():
        torch.nn.functional.linear(x, weight)  # warm: oneDNN builds its kernel on first use
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            best = min(best, time.perf_counter() - started)
    return best


def calibration_dtype(source: Path, choice: str = "auto") -> tuple[str, str]:
    """The dtype name for the calibration forwards of `source`, and why it was chosen."""
    if choice not in CHOICES:
        raise ValueError(f"unknown calibration dtype {choice!r} (choose one of {CHOICES})")
    if choice != "auto":
        return choice, "asked for"
    import torch

    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    inner = int(config.get("hidden_size", 576))
    outer = int(config.get("intermediate_size", 4 * inner))
    bf16 = matmul_seconds(torch.bfloat16, inner, outer)
    fp32 = matmul_seconds(torch.float32, inner, outer)
    speedup = fp32 / bf16
    why = f"bf16 matmul {speedup:.2f}x fp32's here"
    return ("bfloat16" if speedup >= BF16_MARGIN else "float32"), why


def keep_unquantized_in(checkpoint: Path, dtype: str = STORED_DTYPE) -> None:
    """Rewrite a saved checkpoint's floating-point weights other than GPTQ's in `dtype`, and
    config.json's dtype with them; GPTQ's own tensors (qweight, qzeros, scales, g_idx) stay."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    target = getattr(torch, dtype)
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), "pt") as stored:
            metadata = stored.metadata()
        tensors = load_file(str(path))
        changed = {
            name: tensor.to(target)
            for name, tensor in tensors.items()
            if _unquantized(name) and tensor.is_floating_point() and tensor.dtype != target
        }
        if changed:
            save_file({**tensors, **changed}, str(path), metadata=metadata)
    config_file = checkpoint / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["dtype"] = dtype
    config_file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _unquantized(name: str) -> bool:
    return name.rsplit(".", 1)[-1] not in ("qweight", "qzeros", "scales", "g_idx")
