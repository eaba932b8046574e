"""The in-process gate's fp32 candidate with each Linear dequantized at its forward: the same
logits as the model expanded whole, without its fp32 weights held."""

from __future__ import annotations

from pathlib import Path

import torch

from predictor.model.loader import load_checkpoint
from predictor.model.perplexity import load_candidate
from predictor.model.streamed import StreamedLinear


def _float_bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if t.dtype == torch.float32)


def test_the_streamed_candidate_gives_the_expanded_models_logits(tiny_gptq_dir: Path) -> None:
    streamed = load_candidate(tiny_gptq_dir, "cpu", 1, "fp32")
    loaded = load_checkpoint(tiny_gptq_dir, device="cpu", threads=1, kernel="dequantized")
    expanded = torch.nn.Module.float(loaded.model)  # what the "fp32" kernel was before
    linears = [m for m in streamed.model.modules() if isinstance(m, StreamedLinear)]
    assert len(linears) == 2 * 7  # every GPTQ Linear of the 2 layers
    ids = torch.tensor([[1, 17, 300, 4021, 9, 88, 5, 1200]])
    with torch.inference_mode():
        ours = streamed.model(input_ids=ids).logits
        theirs = expanded(input_ids=ids).logits
    assert ours.dtype == torch.float32
    assert torch.equal(ours, theirs)
    # the Linears' fp32 weights are not held: only the embeddings, norms and head are
    held = _float_bytes(streamed.model)
    linear_weights = sum(m.in_features * m.out_features * 4 for m in linears)
    assert held <= _float_bytes(expanded) - linear_weights
