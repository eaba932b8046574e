"""A GPTQ checkpoint run in fp32 for the in-process gate without its weights expanded whole.

evaluate.py's "fp32" kernel measures the quantization alone: every GPTQ Linear's weight
dequantized, rounded to the checkpoint's plain dtype (bf16, as `loader.dense_linear` stores
it), multiplied in fp32. Expanded once for the whole model, that is 8 bytes a weight held at
the same time (the bf16 expansion, then its fp32 copy): 2.2 GB at the 135M shape's
candidate and source side by side, 64 GB at an 8B shape. Here each Linear keeps its packed
tensors (half a byte a weight) and makes that same fp32 weight at each forward, for the one
product, then drops it: the same numbers (tests/model/test_streamed.py compares them with the
expanded model's), and at most one Linear's fp32 weight held beyond the packed checkpoint. The
cost is a dequantization a Linear a forward, small beside the product of a 512-token window.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from predictor.model.gptq import GPTQLinear, load_gptq_model
from predictor.model.loader import check_checkpoint, dense_linear

KERNEL_NAME = "Linear (fp32, dequantized)"  # the numbers of the expanded model's, its name


class StreamedLinear(torch.nn.Module):
    """A GPTQ Linear whose fp32 weight exists only during its forward. The packed module is
    held outside the module tree, so a model-wide `.float()` leaves its tensors as read."""

    def __init__(self, packed: GPTQLinear, rounding: torch.dtype) -> None:
        super().__init__()
        self._packed = (packed,)
        self.rounding = rounding
        self.in_features, self.out_features = packed.in_features, packed.out_features

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = dense_linear(self._packed[0], self.rounding)  # the expanded model's weight
        bias = None if linear.bias is None else linear.bias.float()
        return torch.nn.functional.linear(x, linear.weight.float(), bias)


def load_streamed(path: Path, threads: int = 1) -> tuple[Any, Any]:
    """A GPTQ checkpoint on the CPU and its tokenizer: every GPTQ Linear a StreamedLinear, every
    other tensor fp32. Its logits are those of load_checkpoint(kernel="dequantized") made fp32
    (evaluate.py's "fp32" kernel before this module)."""
    from transformers import AutoTokenizer

    quant = check_checkpoint(path)
    torch.set_num_threads(threads)
    rounding = plain_dtype(path)
    model = load_gptq_model(path, quant, torch.device("cpu"), rounding)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, GPTQLinear):
                setattr(parent, name, StreamedLinear(child, rounding))
    model = torch.nn.Module.float(model).eval()  # transformers' .float() refuses GPTQ models
    return model, AutoTokenizer.from_pretrained(path)


def plain_dtype(path: Path) -> torch.dtype:
    """The dtype the loader keeps a checkpoint's plain tensors in on a CPU: config.json's (bf16
    where it names none), fp16 made bf16."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    found = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype) or found == torch.float16:
        return torch.bfloat16
    return found
