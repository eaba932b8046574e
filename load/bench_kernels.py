"""CPU GPTQ kernel benchmark (a script, not a test): one decode step through our ModelRunner.

Loads the default checkpoint once per variant (a `--kernel` value, optionally with an fp32
lm_head), fills B rows of --context tokens each, then times decode steps (one token per row,
`ModelRunner.forward` with StepRow decode rows) at every batch size and thread count. Rounds
interleave the variants in a new order each time so the shared machine's noise hits them alike;
each figure is the median over all its steps after warm-up. Also: each variant's logits against
an fp32 model of the same dequantized weights, lm_head alone in bf16 and fp32, and (--rss) the
resident memory of each variant loaded alone in a fresh process.

    .venv/bin/python load/bench_kernels.py [--rounds 12] [--rss]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# gptq_torch's torch.compile is measured as it ships (":eager" undoes it per module): dynamo
# must be on before torch is imported
os.environ.pop("TORCHDYNAMO_DISABLE", None)
import torch  # noqa: E402

VARIANTS = [
    "gptq_torch_aten",
    "gptq_torch",
    "gptq_torch:eager",
    "gptq_torch_fused",
    "gptq_torch_int8",
    "dequantized",
    "gptq_torch_aten:fp32head",
    "dequantized:fp32head",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("models/smollm2-135m-instruct-gptq"))
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--context", type=int, default=128, help="tokens already cached per row")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round and figure")
    parser.add_argument("--rss", action="store_true", help="also: RSS of each variant alone")
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    return parser.parse_args()


def setup_env() -> None:
    os.environ.setdefault("HF_HOME", "/tmp/gptq-predictor-hf")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class Fp32Head(torch.nn.Module):
    """lm_head as an fp32 copy of the tied embedding: [R, hidden] -> [R, V] float32."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().float().contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight)


def load_variant(model_dir: Path, variant: str) -> tuple[Any, str]:
    from predictor.model.loader import load_checkpoint

    kernel, _, extra = variant.partition(":")
    loaded = load_checkpoint(model_dir, "cpu", threads=1, kernel=kernel)
    model = loaded.model
    if extra == "eager":  # TorchLinear wraps dequantize_weight in torch.compile per instance
        for module in model.modules():
            if "dequantize_weight" in vars(module):
                del module.dequantize_weight
    if extra == "fp32head":
        model.lm_head = Fp32Head(model.lm_head.weight)
    return model, loaded.kernel


TOKENS: list[int] = []  # load/prompts.txt, tokenized, repeated to a few thousand tokens


def read_tokens(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).encode(
        Path(__file__).with_name("prompts.txt").read_text()
    )
    TOKENS.extend((ids * (1 + 4096 // len(ids)))[:4096])


class Rows:
    """B rows of `context` cached tokens in one runner; decode steps feed one token per row."""

    def __init__(self, model: Any, batch: int, context: int, seed: int = 0) -> None:
        import torch

        from predictor.engine.runners.cpu import ModelRunner
        from predictor.engine.step import StepRow

        self.block = 16
        per_row = (context + 1 + self.block - 1) // self.block
        self.runner = ModelRunner(model, torch.device("cpu"), batch * per_row, self.block)
        self.tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(batch)]
        # real text (load/prompts.txt), so the logits compared below are peaked like a model's
        text = TOKENS[seed % 97 :] + TOKENS
        prompts = [text[i * 7 : i * 7 + context] for i in range(batch)]
        self.context = context
        self.next_ids = [text[i * 7 + context] for i in range(batch)]
        self.StepRow = StepRow
        for table, prompt in zip(self.tables, prompts, strict=True):  # one row at a time
            self.runner.forward([StepRow(table, 0, prompt, True)])

    def step(self, batch: int = 0) -> Any:
        """A decode step of the first `batch` rows (0: all); the cache is left as it was."""
        rows = [
            self.StepRow(t, self.context, [tok], True)
            for t, tok in zip(self.tables, self.next_ids, strict=True)
        ]
        return self.runner.forward(rows[: batch or None])  # [B, V] float32


def rss_mib() -> tuple[float, float]:
    status = Path("/proc/self/status").read_text().splitlines()
    values = {line.split(":")[0]: line.split()[1] for line in status if line.startswith("Vm")}
    return int(values["VmRSS"]) / 1024, int(values["VmHWM"]) / 1024


def rss_child(args: argparse.Namespace) -> None:
    import torch
    import transformers  # noqa: F401

    import predictor.engine.runners.cpu  # noqa: F401  (imports counted in the baseline)

    torch.set_num_threads(1)
    read_tokens(args.model_dir)
    base, _ = rss_mib()
    model, kernel = load_variant(args.model_dir, args.rss_child)
    loaded, _ = rss_mib()
    rows = Rows(model, 16, args.context)
    for _ in range(3):
        rows.step()
    now, peak = rss_mib()
    name = kernel.replace(" ", "_")
    print(f"RSS {args.rss_child} {name} {base:.0f} {loaded:.0f} {now:.0f} {peak:.0f}")


def measure_rss(args: argparse.Namespace) -> None:
    print("\nRSS (MiB), each variant alone in a fresh process, 16 rows of context cached:")
    print(f"{'variant':28} {'kernel':22} {'imports':>8} {'loaded':>7} {'after steps':>12} "
          f"{'model':>6} {'peak':>6}")  # fmt: skip
    for variant in ["auto", *args.variants]:
        done = subprocess.run(
            [sys.executable, __file__, "--model-dir", str(args.model_dir), "--rss-child", variant,
             "--context", str(args.context)],
            capture_output=True, text=True, timeout=600, env=os.environ,
        )  # fmt: skip
        line = [x for x in done.stdout.splitlines() if x.startswith("RSS ")]
        if not line:
            print(f"{variant:28} failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        _, name, kernel, base, loaded, now, peak = line[0].split()
        print(f"{name:28} {kernel:22} {base:>8} {loaded:>7} {now:>12} "
              f"{float(now) - float(base):6.0f} {peak:>6}")  # fmt: skip


def lm_head_alone(model: Any, batches: list[int], threads: list[int]) -> None:
    import torch
    import torch.nn.functional as F

    weight = model.get_input_embeddings().weight.detach()
    w32 = weight.float().contiguous()
    print("\nlm_head alone ([B, 576] x [576, 49152]), median ms of 30:")
    for t in threads:
        torch.set_num_threads(t)
        for b in batches:
            x = torch.randn(b, weight.shape[1], dtype=weight.dtype)
            cells = []
            for w, xx in ((weight, x), (w32, x.float())):
                for _ in range(3):
                    F.linear(xx, w)
                times = []
                for _ in range(30):
                    started = time.perf_counter()
                    F.linear(xx, w)
                    times.append(time.perf_counter() - started)
                cells.append(statistics.median(times) * 1000)
            print(f"  threads {t} batch {b:>2}: bf16 {cells[0]:6.2f}  fp32 {cells[1]:6.2f}")


def main() -> None:
    args = parse_args()
    setup_env()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's predictor
    if args.rss_child:
        rss_child(args)
        return
    import torch

    torch.set_num_threads(1)
    read_tokens(args.model_dir)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    models: dict[str, Any] = {}
    for variant in args.variants:
        started = time.perf_counter()
        models[variant], kernel = load_variant(args.model_dir, variant)
        print(f"loaded {variant} ({kernel}) in {time.perf_counter() - started:.1f} s", flush=True)

    # accuracy: every variant's decode logits at batch 16 against fp32 dequantized weights
    reference, _ = load_variant(args.model_dir, "dequantized")
    for p in reference.parameters():
        p.data = p.data.float()
    ref = Rows(reference, 16, args.context).step()
    del reference
    accuracy: dict[str, str] = {}
    rows_of = {v: Rows(m, max(args.batches), args.context) for v, m in models.items()}
    for variant, rows in rows_of.items():
        out = rows.step()
        agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
        accuracy[variant] = f"{(out - ref).abs().max().item():.2f} / {agree:.0%}"
    del ref

    times: dict[tuple[str, int, int], list[float]] = {k: [] for k in
        ((v, b, t) for v in models for b in args.batches for t in args.threads)}  # fmt: skip
    for variant, batch in ((v, b) for v in models for b in args.batches):  # warm-up
        started = time.perf_counter()
        for t in args.threads:
            torch.set_num_threads(t)
            for _ in range(3):
                rows_of[variant].step(batch)
        print(f"warm {variant} batch {batch}: {time.perf_counter() - started:.1f} s", flush=True)
    order = list(times)
    for r in range(args.rounds):
        random.Random(r).shuffle(order)
        for variant, batch, t in order:
            torch.set_num_threads(t)
            rows = rows_of[variant]
            rows.step(batch)  # re-warm after the thread switch
            for _ in range(args.steps):
                started = time.perf_counter()
                rows.step(batch)
                times[(variant, batch, t)].append(time.perf_counter() - started)
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    print(f"load average at end: {os.getloadavg()}")
    head = " ".join(f"{f'B={b} T={t}':>14}" for t in args.threads for b in args.batches)
    print(f"\nms per decode step, median (min) of {args.rounds * args.steps}, "
          f"context {args.context}:")  # fmt: skip
    print(f"{'variant':28} {head}  max|dlogit| / argmax vs fp32")
    for variant in models:
        cells = " ".join(
            f"{statistics.median(times[(variant, b, t)]) * 1000:7.1f} "
            f"({min(times[(variant, b, t)]) * 1000:4.0f})"
            for t in args.threads
            for b in args.batches
        )
        print(f"{variant:28} {cells}  {accuracy[variant]}")
    print("\ntokens/s at batch 16 = 16000 / (ms per step)")
    lm_head_alone(models[args.variants[0]], args.batches, args.threads)
    if args.rss:
        models.clear()
        measure_rss(args)


if __name__ == "__main__":
    main()
