"""predictor.model.served: a checkpoint's perplexity as the real server serves it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from predictor.model.perplexity import sequence_perplexity
from predictor.model.served import served_figures, served_perplexity


def test_served_perplexity_is_the_in_process_one(tiny_gptq_dir: Path) -> None:
    """The tiny GPTQ model through the server (its default kernels) against the same checkpoint
    dequantized in fp32 in process, on the same 96 tokens: within 2%."""
    ids = [(7919 * i) % 40000 + 100 for i in range(96)]
    served = served_perplexity(tiny_gptq_dir, ids)
    assert math.isfinite(served) and served > 1
    assert served == pytest.approx(sequence_perplexity(tiny_gptq_dir, ids), rel=0.02)


def test_a_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="the server exited with"):
        served_perplexity(tmp_path / "no-model", [1, 2, 3], ready_timeout=120)


def test_served_figures_with_a_kernel_named(tiny_bf16_dir: Path) -> None:
    """The native kernels' checkpoint served with fp32 activations forced: its perplexity, the
    in-process one within 2%, and its decode speed."""
    ids = [(7919 * i) % 40000 + 100 for i in range(96)]
    figures = served_figures(tiny_bf16_dir, ids, kernel="native_f32")
    assert figures["perplexity"] == pytest.approx(sequence_perplexity(tiny_bf16_dir, ids), rel=0.02)
    assert figures["tokens_per_second"] > 0
