"""Profile of a C=16 decode step (a script, not a test): torch.profiler over the runner.

Fills 16 rows (row i holds 96 + 2 i tokens of load/prompts.txt), warms up, then profiles
--steps decode steps and prints the top ops by self CPU time with their share of the step, and
the step's wall time measured without the profiler. Works on either engine:

- this checkout's `ModelRunner.forward` (paged KV cache, one flat batch of StepRows), and
- the engine before the rewrite (commit 30b2f7a: left-padded DynamicCache, `model.forward` per
  step; `ModelRunner.prefill` / `decode`), given a checkout of it with --tree:

    git worktree add /tmp/before 30b2f7a
    .venv/bin/python load/profile_step.py --tree /tmp/before
    .venv/bin/python load/profile_step.py [--kernel dequantized]
    .venv/bin/python load/profile_step.py --attention   # one layer's decode attention, 4 ways
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-dir", type=Path, default=REPO / "models/smollm2-135m-instruct-gptq"
    )
    parser.add_argument("--tree", type=Path, default=REPO, help="checkout whose predictor runs")
    parser.add_argument("--kernel", default="auto", help="--kernel value (this checkout only)")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="profiled steps")
    parser.add_argument("--timed", type=int, default=20, help="steps timed without profiler")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--attention",
        action="store_true",
        help="only: time one layer's decode attention, 4 ways",
    )
    return parser.parse_args()


def prompts(tokenizer: Any, rows: int) -> list[list[int]]:
    ids = tokenizer.encode(REPO.joinpath("load/prompts.txt").read_text())
    ids = (ids * 8)[:4096]
    return [ids[i * 11 : i * 11 + 96 + 2 * i] for i in range(rows)]


class PagedRows:
    """After the rewrite: every row in its own blocks; a step is one forward of StepRows.

    Blocks come from the engine's BlockAllocator as the step loop takes them: a row's prompt
    blocks at once (placed where its reservation of prompt + 256 tokens fits), then one more
    whenever a row's tokens fill its last block (next to it if free), as in the server."""

    def __init__(self, model: Any, rows: list[list[int]]) -> None:
        import torch

        from predictor.engine.kv_cache import BlockAllocator, blocks_for
        from predictor.engine.runners.cpu import ModelRunner
        from predictor.engine.step import StepRow

        self.StepRow = StepRow
        per_row = 1 + (max(map(len, rows)) + 256) // 16
        self.allocator = BlockAllocator(len(rows) * per_row, 16)
        self.runner = ModelRunner(model, torch.device("cpu"), len(rows) * per_row, 16)
        self.tables = [
            self.allocator.allocate(blocks_for(len(r), 16), claim=blocks_for(len(r) + 256, 16))
            for r in rows
        ]
        self.lengths = [len(r) for r in rows]
        logits = self.runner.forward(
            [StepRow(t, 0, r, True) for t, r in zip(self.tables, rows, strict=True)]
        )
        self.last = logits.argmax(-1).tolist()

    def step(self) -> None:
        for table, n in zip(self.tables, self.lengths, strict=True):
            if n == len(table) * 16:  # the next token starts a block
                table.extend(self.allocator.allocate(1, after=table[-1]))
        rows = [
            self.StepRow(t, n, [tok], True)
            for t, n, tok in zip(self.tables, self.lengths, self.last, strict=True)
        ]
        self.last = self.runner.forward(rows).argmax(-1).tolist()
        self.lengths = [n + 1 for n in self.lengths]


class PaddedRows:
    """Before the rewrite: one left-padded DynamicCache; prefill all rows, then decode."""

    def __init__(self, model: Any, rows: list[list[int]], pad_token_id: int) -> None:
        import torch

        from predictor.engine.runners.cpu import ModelRunner

        self.runner: Any = ModelRunner(model, torch.device("cpu"), pad_token_id)
        self.last = self.runner.prefill(rows).argmax(-1).tolist()

    def step(self) -> None:
        self.last = self.runner.decode(self.last).argmax(-1).tolist()


def attention_variants(rows: int, threads: int, length: int = 150) -> None:
    """One layer's decode attention for `rows` rows, SmolLM2's shapes (9 heads, 3 KV heads)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    heads, kv_heads, dim = 9, 3, 64
    group = heads // kv_heads
    pool = torch.randn(4096, kv_heads, dim, dtype=torch.bfloat16)  # a layer's key slots
    slots = torch.randint(0, 4096, (rows, length))  # [d, L]
    query = torch.randn(rows, heads, 1, dim, dtype=torch.bfloat16)
    lengths = torch.arange(rows) + length - rows
    mask = (torch.arange(length) < lengths.unsqueeze(1)).view(rows, 1, 1, length)
    keys = pool[slots].transpose(1, 2)  # [d, kv_heads, L, dim], as the runner gathers them
    values = pool[slots].transpose(1, 2)
    bias = torch.zeros(rows, 1, 1, length, dtype=torch.bfloat16).masked_fill(~mask, -torch.inf)
    packed = query.view(rows, kv_heads, group, dim)  # a group's query heads as query rows

    def grouped_matmul() -> torch.Tensor:
        scores = torch.matmul(packed, keys.transpose(-1, -2)) * dim**-0.5 + bias
        return torch.matmul(scores.softmax(-1), values)  # [d, kv_heads, group, dim]

    variants = {
        "gather the keys (keys[slots], one of 2 per layer)": lambda: pool[slots],
        "SDPA enable_gqa, bool mask (the runner today)": lambda: F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, enable_gqa=True
        ),
        "SDPA, query heads packed per KV head (transformers' pack_gqa)": lambda: (
            F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask)
        ),
        "matmul-softmax-matmul, query heads packed per KV head": grouped_matmul,
    }
    print(f"decode attention of one layer, {rows} rows of <= {length} keys, {threads} thread(s):")
    for name, run in variants.items():
        run()
        times = []
        for _ in range(50):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        print(f"  {name:64} {statistics.median(times) * 1000:6.2f} ms")


def main() -> None:
    args = parse_args()
    if args.attention:
        attention_variants(args.rows, args.threads)
        return
    os.environ.setdefault("HF_HOME", "/tmp/gptq-predictor-hf")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(args.tree.resolve()))
    import torch
    from torch.profiler import ProfilerActivity, profile

    import predictor
    from predictor.engine.runners import cpu as runner_module
    from predictor.model.loader import load_checkpoint

    assert Path(predictor.__file__).resolve().is_relative_to(args.tree.resolve())
    paged = hasattr(runner_module, "StepRow")
    options = {"kernel": args.kernel} if args.kernel != "auto" else {}
    loaded = load_checkpoint(args.model_dir, "cpu", threads=args.threads, **options)
    torch.set_num_threads(args.threads)
    rows = prompts(loaded.tokenizer, args.rows)
    engine = PagedRows(loaded.model, rows) if paged else PaddedRows(
        loaded.model, rows, loaded.pad_token_id
    )  # fmt: skip
    kernel = getattr(engine.runner, "_native", None)
    if kernel is not None:  # a ctypes call: shown in the table under its own name

        def named(*args: Any) -> None:
            with torch.profiler.record_function("native::decode_attention"):
                kernel(*args)

        engine.runner._native = named
    for _ in range(5):
        engine.step()
    times = []
    for _ in range(args.timed):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    wall = statistics.median(times) * 1000
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / args.steps / 1000  # ms per step
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    engine_name = "paged runner (forward)" if paged else "padded runner (model.forward)"
    print(f"{engine_name}, tree {args.tree}, kernel {loaded.kernel}, {args.rows} rows "
          f"(contexts {len(rows[0])}-{len(rows[-1])} + {5 + args.timed} decoded), "
          f"{args.threads} thread(s), load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"step wall time without profiler: median {wall:.1f} ms of {args.timed}; "
          f"with profiler: {total:.1f} ms of op self time per step")  # fmt: skip
    print("\n| op | self CPU ms/step | share | calls/step |\n|---|---|---|---|")
    for e in top:
        ms = e.self_cpu_time_total / args.steps / 1000
        print(f"| `{e.key}` | {ms:.2f} | {ms / total:.0%} | {e.count // args.steps} |")
    calls = sum(e.count for e in events) / args.steps
    print(f"\nops per step: {calls:.0f}")


if __name__ == "__main__":
    main()
