"""Measure a checkpoint's quality before serving it: perplexity and greedy agreement.

`python -m predictor.model.evaluate CHECKPOINT [--reference SOURCE] [--out report.json]` scores any
GPTQ or plain (fp32/bf16) transformers checkpoint folder on the project's held-out text
(heldout.txt, written for the project and never used for calibration): perplexity over its first
1,536 tokens in 512-token windows. With a reference (the fp model a GPTQ checkpoint was made from)
it also gives the ratio of the two perplexities and the share of greedy next tokens that agree on
the reference's own greedy answers to a fixed set of chat prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from predictor.model.quantize import prepare_environment

HELDOUT_TEXT = Path(__file__).with_name("heldout.txt")
MAX_TOKENS = 1536
WINDOW = 512
NEW_TOKENS = 32
# Fixed chat prompts for the greedy agreement check: varied tasks, none from the calibration set.
PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for keeping houseplants alive.",
    "Explain in two sentences why the sky is blue.",
    "Write a short, friendly email asking a colleague to move our meeting to Friday.",
    "What is 17 multiplied by 6? Show your working.",
    "Summarize the plot of Little Red Riding Hood in one paragraph.",
    "List four animals that live in the Arctic.",
    "How do I boil an egg so the yolk stays soft?",
)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Scored:
    """One checkpoint's figures."""

    path: str
    kind: str  # "gptq" or "fp"
    kernel: str  # the GPTQ kernel class, or the fp dtype
    perplexity: float
    tokens: int  # held-out tokens scored
    seconds: float


@dataclass(frozen=True)
class QualityReport:
    checkpoint: Scored
    reference: Scored | None
    ratio: float | None  # checkpoint perplexity / reference perplexity
    agreement: float | None  # share of greedy next tokens that match the reference's
    agreed: int
    compared: int
    prompts: int
    window: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Candidate:
    """A loaded checkpoint: the model, its tokenizer and what it is."""

    model: Any
    tokenizer: Any
    kind: str
    kernel: str


def checkpoint_kind(path: Path) -> str:
    """'gptq' for a GPTQ checkpoint folder, 'fp' for a plain one; SystemExit when neither."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise SystemExit(f"{path} is not a checkpoint folder: it has no config.json")
    quant = json.loads(config_file.read_text()).get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    if method == "gptq":
        return "gptq"
    if method:
        raise SystemExit(f"{path}: quantization method {method!r} is not supported (GPTQ or fp)")
    return "fp"


def load_candidate(path: Path, device: str = "cpu", threads: int = 1) -> Candidate:
    """Load a GPTQ checkpoint the way the server does, or an fp one in its stored dtype."""
    import torch

    from predictor.model.loader import load_checkpoint, pick_device

    kind = checkpoint_kind(path)
    if kind == "gptq":
        loaded = load_checkpoint(path, device=device, threads=threads)
        return Candidate(loaded.model, loaded.tokenizer, kind, loaded.kernel)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    target = pick_device(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    model = model.to(target).eval()
    return Candidate(model, tokenizer, kind, str(model.dtype).removeprefix("torch."))


def heldout_ids(tokenizer: Any, max_tokens: int = MAX_TOKENS) -> list[int]:
    text = HELDOUT_TEXT.read_text(encoding="utf-8")
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < max_tokens:
        raise SystemExit(f"{HELDOUT_TEXT} has {len(ids)} tokens, fewer than {max_tokens}")
    return ids[:max_tokens]


def perplexity(model: Any, ids: Sequence[int], window: int, progress: Progress) -> float:
    """exp(mean next-token loss) over consecutive, non-overlapping windows of the ids."""
    import torch

    device = next(model.parameters()).device
    total, count = 0.0, 0
    starts = range(0, len(ids) - 1, window)
    for number, start in enumerate(starts, 1):
        chunk = torch.tensor([ids[start : start + window]], device=device)  # [1, S]
        if chunk.shape[1] < 2:
            break
        progress(f"perplexity window {number}/{len(starts)}")
        with torch.inference_mode():
            logits = model(input_ids=chunk).logits[0, :-1].float()  # [S-1, V]
        loss = torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum")
        total += float(loss)
        count += chunk.shape[1] - 1
    return math.exp(total / count)


def greedy_sequences(
    candidate: Candidate, prompts: Sequence[str], new_tokens: int, progress: Progress
) -> list[tuple[list[int], int]]:
    """The model's greedy answer to each chat prompt: (prompt + answer ids, prompt length)."""
    import torch

    model, tokenizer = candidate.model, candidate.tokenizer
    sequences = []
    for number, prompt in enumerate(prompts, 1):
        progress(f"greedy answer {number}/{len(prompts)}")
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        ).to(next(model.parameters()).device)
        with torch.inference_mode():
            out = model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        sequences.append((out[0].tolist(), int(inputs["input_ids"].shape[1])))
    return sequences


def next_token_choices(
    model: Any, sequences: Sequence[tuple[list[int], int]], progress: Progress
) -> list[list[int]]:
    """Greedy next-token choice at every answer position, teacher-forced on the sequences."""
    import torch

    device = next(model.parameters()).device
    choices = []
    for number, (ids, prompt_length) in enumerate(sequences, 1):
        progress(f"greedy agreement {number}/{len(sequences)}")
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0]  # [S, V]
        choices.append(logits[prompt_length - 1 : -1].argmax(-1).tolist())
    return choices


def evaluate(
    checkpoint: Path,
    reference: Path | None = None,
    *,
    max_tokens: int = MAX_TOKENS,
    window: int = WINDOW,
    prompts: Sequence[str] = PROMPTS,
    new_tokens: int = NEW_TOKENS,
    device: str = "cpu",
    threads: int = 1,
    progress: Progress | None = None,
) -> QualityReport:
    """Score a checkpoint, and against a reference when one is given."""
    say = progress or (lambda _message: None)
    sequences: list[tuple[list[int], int]] = []
    reference_choices: list[list[int]] = []
    scored_reference = None
    if reference is not None:
        say(f"loading reference {reference}")
        started = time.monotonic()
        loaded = load_candidate(reference, device, threads)
        ppl = perplexity(loaded.model, heldout_ids(loaded.tokenizer, max_tokens), window, say)
        sequences = greedy_sequences(loaded, prompts, new_tokens, say)
        reference_choices = next_token_choices(loaded.model, sequences, say)
        scored_reference = Scored(
            str(reference), loaded.kind, loaded.kernel, ppl, max_tokens, time.monotonic() - started
        )
        del loaded
    say(f"loading checkpoint {checkpoint}")
    started = time.monotonic()
    loaded = load_candidate(checkpoint, device, threads)
    ppl = perplexity(loaded.model, heldout_ids(loaded.tokenizer, max_tokens), window, say)
    choices = next_token_choices(loaded.model, sequences, say) if sequences else []
    scored = Scored(
        str(checkpoint), loaded.kind, loaded.kernel, ppl, max_tokens, time.monotonic() - started
    )
    pairs = [
        (a, b)
        for mine, theirs in zip(choices, reference_choices, strict=True)
        for a, b in zip(mine, theirs, strict=True)
    ]
    agreed = sum(a == b for a, b in pairs)
    return QualityReport(
        checkpoint=scored,
        reference=scored_reference,
        ratio=ppl / scored_reference.perplexity if scored_reference else None,
        agreement=agreed / len(pairs) if pairs else None,
        agreed=agreed,
        compared=len(pairs),
        prompts=len(prompts) if reference is not None else 0,
        window=window,
    )


def format_report(report: QualityReport) -> str:
    rows = [report.checkpoint] + ([report.reference] if report.reference else [])
    width = max(len("checkpoint"), *(len(row.path) for row in rows))
    lines = [f"{'checkpoint':<{width}}  kind  {'kernel/dtype':<16}  perplexity  seconds"]
    for row in rows:
        lines.append(
            f"{row.path:<{width}}  {row.kind:<4}  {row.kernel:<16}  {row.perplexity:>10.3f}"
            f"  {row.seconds:>7.1f}"
        )
    lines.append(f"held-out text: {report.checkpoint.tokens} tokens, {report.window}-token windows")
    if report.ratio is not None and report.agreement is not None:
        lines.append(
            f"perplexity ratio {report.ratio:.3f}; greedy agreement {report.agreement:.1%} "
            f"({report.agreed}/{report.compared} tokens over {report.prompts} prompts)"
        )
    return "\n".join(lines)


def print_progress(message: str) -> None:
    print(f"[evaluate] {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m predictor.model.evaluate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("checkpoint", type=Path, help="GPTQ or fp checkpoint folder")
    parser.add_argument("--reference", type=Path, help="the fp checkpoint it was quantized from")
    parser.add_argument("--out", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--tokens", type=int, default=MAX_TOKENS, help="held-out tokens to score")
    parser.add_argument("--window", type=int, default=WINDOW, help="tokens per forward pass")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    prepare_environment(os.environ, Path.home() / ".cache" / "huggingface", args.threads)
    report = evaluate(
        args.checkpoint,
        args.reference,
        max_tokens=args.tokens,
        window=args.window,
        device=args.device,
        threads=args.threads,
        progress=print_progress,
    )
    print(format_report(report))
    if args.out:
        args.out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
