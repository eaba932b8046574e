"""Issue 69's memory bound, held by a real `quantize --source` build of a tiny shape: the RSS of
its process tree sampled every 0.2 s (load/bench_quantize.py's sampler) must stay within
1.5x a layer's fp32 weights + the calibration activations + 2 GB, and the build's own process
must hold no model: its phases run in processes of their own."""

from __future__ import annotations

import sys
from pathlib import Path

from load.bench_quantize import bound_bytes, calibration_tokens, run_sampled, write_source
from load.random_gptq import SHAPES

TEXTS = 16
# The build's own process: the interpreter, torch, transformers' tokenizer and the calibration
# dtype's timing matmuls, never a model: 0.40 GiB at the 135M shape; a model or a phase's leftovers
# (the old single-process build kept 3-4 GiB at the 135M shape) would be well past this.
BUILDER_CEILING = 0.9 * 1024**3


def test_a_tiny_build_stays_within_the_memory_bound(tokenizer_dir: Path, tmp_path: Path) -> None:
    shape = SHAPES["tiny"]
    source = write_source(tmp_path / "tiny-bf16", shape, tokenizer_dir)
    command = [sys.executable, "-m", "predictor.model.quantize", "--source", str(source),
               "--out", str(tmp_path / "tiny-gptq"), "--texts", str(TEXTS), "--threads", "1",
               "--group-size", "64", "--max-ratio", "1000"]  # fmt: skip
    log = tmp_path / "quantize.log"
    code, _, peaks = run_sampled(command, log)
    assert code == 0, log.read_text()[-3000:]
    assert {"gptq", "evaluate", "served"} <= peaks.keys()  # every phase sampled
    bound = bound_bytes(shape, calibration_tokens(TEXTS))["bound"]
    gib = 1024**3
    figures = ", ".join(f"{name} {value / gib:.2f} GiB" for name, value in peaks.items())
    assert peaks["all"] <= bound, f"past the bound {bound / gib:.2f} GiB: {figures}"
    assert peaks["builder"] <= BUILDER_CEILING, figures
    # the phases ran beside the builder, not in it: each phase's tree holds more than it
    assert min(peaks[name] for name in ("gptq", "evaluate", "served")) > peaks["builder"]
