"""What a checkpoint's layout costs the runner (a script, not a test).

Random-weight GPTQ checkpoints of one shape (load/random_gptq.py) in several layouts, each
loaded as the server loads it; the runner's decode step timed at 1 and 16 rows, the layouts
interleaved round after round (the machine is shared and noisy), each against its baseline:
fp16 against the same layout in bf16, act-order against plain 4-bit, 8-bit against its own
weights dequantized.

    .venv/bin/python -m load.bench_layouts [--shape smollm2-135m] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from load.random_gptq import SHAPES, Layout, write_checkpoint
from predictor.engine.runners.cpu import ModelRunner
from predictor.engine.step import StepRow
from predictor.model.loader import load_checkpoint

LAYOUTS = {
    "4bit-g64-bf16": (Layout(4, 64, sym=True), "auto"),
    "4bit-g64-fp16": (Layout(4, 64, sym=True, dtype=torch.float16), "auto"),
    "4bit-g64-act-order": (Layout(4, 64, sym=True, desc_act=True), "auto"),
    "8bit-g64": (Layout(8, 64, sym=True), "auto"),
    "8bit-g64-dequantized": (Layout(8, 64, sym=True), "dequantized"),
}
BASELINE = {
    "4bit-g64-fp16": "4bit-g64-bf16",
    "4bit-g64-act-order": "4bit-g64-bf16",
    "8bit-g64": "8bit-g64-dequantized",
}


def step_seconds(runner: ModelRunner, rows: int, steps: int) -> float:
    """Median seconds of a decode step of `rows` rows (after a 20-token prefill each)."""
    rng = random.Random(0)
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(rows)]
    runner.forward([StepRow(t, 0, [rng.randrange(100, 4000) for _ in range(20)], True)
                    for t in tables])  # fmt: skip
    times = []
    for k in range(steps):
        batch = [StepRow(t, 20 + k, [rng.randrange(100, 4000)], True) for t in tables]
        start = time.perf_counter()
        runner.forward(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--tokenizer", type=Path, default=Path("models/smollm2-135m-instruct-fp"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="bench-layouts-"))
    runners = {}
    for name, (layout, kernel) in LAYOUTS.items():
        path = write_checkpoint(folder / name, SHAPES[args.shape], layout, args.tokenizer)
        loaded = load_checkpoint(path, device="cpu", threads=args.threads, kernel=kernel)
        runner = ModelRunner(loaded.model, torch.device("cpu"), 16 * 8, 16)
        runner.bind_thread()
        fused = sum(f is not None for f in runner._fused)
        print(f"{name}: {fused}/{len(runner._fused)} layers fused, plain tensors "
              f"{loaded.model.get_input_embeddings().weight.dtype}")  # fmt: skip
        runners[name] = runner
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for rows in (1, 16):
            for name, runner in runners.items():
                times.setdefault((name, rows), []).append(step_seconds(runner, rows, args.steps))
    print(f"\n{args.shape}, {args.threads} thread(s), median decode step over {args.rounds} "
          "rounds; ratio: baseline's step time / this one's (>= 1: as fast)")  # fmt: skip
    print("| layout | 1 row | 16 rows | vs baseline, 1 / 16 rows |")
    print("|---|---|---|---|")
    for name in runners:
        one, many = (statistics.median(times[(name, r)]) for r in (1, 16))
        ratio = ""
        if name in BASELINE:
            base = BASELINE[name]
            ratio = " / ".join(
                f"{statistics.median(times[(base, r)]) / statistics.median(times[(name, r)]):.2f}x"
                for r in (1, 16)
            )
            ratio += f" ({base})"
        print(f"| {name} | {one * 1000:.1f} ms | {many * 1000:.1f} ms | {ratio} |")


if __name__ == "__main__":
    main()
