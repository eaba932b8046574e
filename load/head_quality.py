"""Quality of the lm_head kernels (a script, not a test): perplexity and greedy agreement of the
default GPTQ checkpoint with its lm_head run by the module itself (bf16) and by int8_matmul.c
(int8 or fp32 activations), scored as `make model`'s gate scores it (predictor/model/evaluate.py:
the test text's perplexity over the fp reference's, greedy next-token agreement on the reference's
answers), plus each kernel's agreement with the bf16 head's greedy tokens.

    .venv/bin/python -m load.head_quality [--heads module int8_i8 int8_f32]

`--table`: instead, what a server serves where lm_head runs from its int8 table (the head's
bf16 weights and a tied embedding's let go, the embedding's rows read from that table): both
texts' perplexity with the tied table as loaded (bf16) and as the int8 table's rows, the
checkpoint dequantized exactly in fp32 otherwise.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def native_head(module: Any, name: str) -> Any:
    """An lm_head module whose matmul is one of the runner's head kernels."""
    import torch

    from predictor.engine.runners.kernels.head_linear import head_candidates

    class NativeHead(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            matches = [key for key in head_candidates(module) if key.startswith(name)]
            if not matches:
                raise SystemExit(f"no lm_head kernel {name} on this CPU")
            self.name = matches[0]
            self.kernel = head_candidates(module)[self.name]()

        def forward(self, hidden: Any) -> Any:
            flat = hidden.reshape(-1, hidden.shape[-1])
            return self.kernel(flat).reshape(*hidden.shape[:-1], -1)

    return NativeHead()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkpoint", type=Path, default=REPO / "models/smollm2-135m-instruct-gptq"
    )
    parser.add_argument("--reference", type=Path, default=REPO / "models/smollm2-135m-instruct-fp")
    parser.add_argument("--heads", nargs="+", default=["module", "int8_i8", "int8_f32"])
    parser.add_argument("--table", action="store_true", help="the tied table: int8 or bf16")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.table:
        int8_table(args.checkpoint)
        return
    from predictor.model import evaluate

    original = evaluate.load_candidate
    chosen: dict[str, str] = {}
    reports = {}
    for head in args.heads:

        def patched(*a: Any, head: str = head, **k: Any) -> Any:
            candidate = original(*a, **k)
            if head != "module" and candidate.kind == "gptq":
                wrapped = native_head(candidate.model.lm_head, head)
                chosen[head] = wrapped.name
                candidate.model.lm_head = wrapped
            return candidate

        evaluate.load_candidate = patched
        reports[head] = evaluate.evaluate(args.checkpoint, args.reference, kernel="auto")
        evaluate.load_candidate = original
        report = reports[head]
        scored = report.checkpoint
        print(f"{chosen.get(head, head)}: test ppl {scored.perplexity:.4f} "
              f"(ratio {report.ratio:.4f}), validation ppl {scored.validation_perplexity:.4f} "
              f"(ratio {report.validation_ratio:.4f}), agreement with the fp reference "
              f"{report.agreed}/{report.compared}", flush=True)  # fmt: skip


def int8_table(checkpoint: Path) -> None:
    """Each text's perplexity (evaluate's tokens and windows) with the tied embedding and head
    as loaded and as read from the int8 table (head_linear.Int8Head.rows)."""
    import math

    import torch

    from predictor.engine.runners.kernels.head_linear import head_candidates
    from predictor.model.loader import load_checkpoint
    from predictor.model.perplexity import TEXTS, WINDOW, text_ids

    loaded = load_checkpoint(checkpoint, device="cpu", threads=2, kernel="dequantized",
                             dtype=torch.float32)  # fmt: skip
    model = loaded.model
    table = model.get_input_embeddings().weight
    if model.get_output_embeddings().weight is not table:
        raise SystemExit(f"{checkpoint}: its head is not tied to its embedding")
    bf16 = table.detach().bfloat16()
    head = torch.nn.Linear(bf16.shape[1], bf16.shape[0], bias=False).bfloat16()
    head.weight.data = bf16
    int8 = next(make for key, make in head_candidates(head).items() if key.startswith("int8_"))()
    tables = {"bf16, as loaded": bf16.float(),
              "int8 (Q8_0 layout)": int8.rows(torch.arange(bf16.shape[0])).float()}  # fmt: skip
    for name, path in TEXTS.items():
        ids = text_ids(loaded.tokenizer, path)
        for label, values in tables.items():
            table.data = values  # the head is tied: the same tensor
            total, count = 0.0, 0
            with torch.inference_mode():
                for start in range(0, len(ids) - 1, WINDOW):
                    window = ids[start : start + WINDOW + 1]
                    logits = model(torch.tensor([window[:-1]])).logits[0].float()
                    total += float(torch.nn.functional.cross_entropy(
                        logits, torch.tensor(window[1:]), reduction="sum"))  # fmt: skip
                    count += len(window) - 1
            print(f"{name} ({len(ids)} tokens), {label}: perplexity {math.exp(total / count):.4f}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
