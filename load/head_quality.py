"""Quality of the lm_head kernels (a script, not a test): perplexity and greedy agreement of the
default GPTQ checkpoint with its lm_head run by the module itself (bf16) and by int8_matmul.c
(int8 or fp32 activations), scored as `make model`'s gate scores it (predictor/model/evaluate.py:
the test text's perplexity over the fp reference's, greedy next-token agreement on the reference's
answers), plus each kernel's agreement with the bf16 head's greedy tokens.

    .venv/bin/python -m load.head_quality [--heads module int8_i8 int8_f32]
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
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
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


if __name__ == "__main__":
    main()
