"""Measure a checkpoint's quality before serving it: perplexity and greedy agreement.

`python -m predictor.model.evaluate CHECKPOINT [--reference SOURCE] [--out report.json]` scores any
GPTQ or plain (fp32/bf16) transformers checkpoint folder on the project's two evaluation texts
(their perplexity: `perplexity.py`; the test text's is the one reported and gated on). With a
reference (the fp model a GPTQ checkpoint was made from) it also gives the ratio of the two
perplexities on each text and the share of greedy next tokens that agree on the reference's own
greedy answers to a fixed set of chat prompts. The reference's figures are cached in its folder
(reference.json), so a second build does not compute them again, and the default model source's
ship with the package (predictor.model.reference_cache), so a first build does not either.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from predictor.model import heap, reference_cache
from predictor.model.agreement import (
    NEW_TOKENS,
    PROMPTS,
    Progress,
    greedy_sequences,
    next_token_choices,
)
from predictor.model.env import prepare_environment
from predictor.model.perplexity import (
    MAX_TOKENS,
    TEST_TEXT,
    TEXTS,
    VALIDATION_TEXT,
    WINDOW,
    load_candidate,
    perplexities,
    perplexity,
)


@dataclass(frozen=True)
class Scored:
    """One checkpoint's figures."""

    path: str
    kind: str  # "gptq" or "fp"
    kernel: str  # the GPTQ kernel class, or the fp dtype
    perplexity: float  # on the test text
    validation_perplexity: float
    tokens: int  # tokens scored on each text
    seconds: float


@dataclass(frozen=True)
class QualityReport:
    checkpoint: Scored
    reference: Scored | None
    ratio: float | None  # checkpoint perplexity / reference perplexity, on the test text
    validation_ratio: float | None  # the same on the validation text
    agreement: float | None  # share of greedy next tokens that match the reference's
    agreed: int
    compared: int
    prompts: int
    window: int
    # where the reference's figures came from: "computed", or the cache file that held them
    reference_figures: str | None = None

    def to_json(self) -> dict[str, Any]:
        texts = {name: {"file": path.name} for name, path in TEXTS.items()}
        return {**asdict(self), "texts": texts, "gated_on": "test"}


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
    cache: bool = True,
    kernel: str = "auto",
) -> QualityReport:
    """Score a checkpoint, and against a reference when one is given.

    The reference's figures come from its cache (reference_cache) when `cache` and still valid.
    """
    say = progress or (lambda _message: None)
    sequences: list[tuple[list[int], int]] = []
    reference_choices: list[list[int]] = []
    scored_reference, origin = None, None
    if reference is not None:
        settings = reference_settings(max_tokens, window, prompts, new_tokens, device)
        scored_reference, sequences, reference_choices, origin = score_reference(
            reference, settings, threads, say, cache
        )
        heap.release()  # the reference's pages, before the candidate's are made
    say(f"loading checkpoint {checkpoint}")
    started = time.monotonic()
    loaded = load_candidate(checkpoint, device, threads, kernel)
    ppl = {name: perplexity(w) for name, w in perplexities(loaded, max_tokens, window, say).items()}
    choices = next_token_choices(loaded.model, sequences, say) if sequences else []
    scored = Scored(
        str(checkpoint),
        loaded.kind,
        loaded.kernel,
        ppl["test"],
        ppl["validation"],
        max_tokens,
        time.monotonic() - started,
    )
    pairs = [
        (a, b)
        for mine, theirs in zip(choices, reference_choices, strict=True)
        for a, b in zip(mine, theirs, strict=True)
    ]
    agreed = sum(a == b for a, b in pairs)
    ref = scored_reference
    return QualityReport(
        checkpoint=scored,
        reference=ref,
        ratio=scored.perplexity / ref.perplexity if ref else None,
        validation_ratio=scored.validation_perplexity / ref.validation_perplexity if ref else None,
        agreement=agreed / len(pairs) if pairs else None,
        agreed=agreed,
        compared=len(pairs),
        prompts=len(prompts) if reference is not None else 0,
        window=window,
        reference_figures=origin,
    )


def reference_settings(
    max_tokens: int = MAX_TOKENS,
    window: int = WINDOW,
    prompts: Sequence[str] = PROMPTS,
    new_tokens: int = NEW_TOKENS,
    device: str = "cpu",
) -> dict[str, Any]:
    """What the reference's figures depend on besides its files and the texts."""
    return {
        "max_tokens": max_tokens,
        "window": window,
        "prompts": list(prompts),
        "new_tokens": new_tokens,
        "device": device,
    }


def score_reference(
    reference: Path, settings: dict[str, Any], threads: int, say: Progress, cache: bool
) -> tuple[Scored, list[tuple[list[int], int]], list[list[int]], str]:
    """The reference's figures, greedy answers and next-token choices, cached or computed, and
    where they came from."""
    key = reference_cache.cache_key(reference, TEXTS, settings)
    stored = reference_cache.load(reference, key) if cache else None
    if stored is not None:
        figures = stored.figures
        how = "shipped" if stored.file == reference_cache.SHIPPED else "cached"
        origin = f"{how}: {stored.file.name}"
        say(f"reference {reference}: {how} figures ({stored.file.name}, the same key)")
        scored = Scored(**{**figures["scored"], "path": str(reference)})
        sequences = reference_cache.as_sequences(figures["sequences"])
        return scored, sequences, figures["choices"], origin
    figures = compute_reference(reference, settings, threads, say)
    if cache:
        reference_cache.store(reference, key, figures)
    scored = Scored(**figures["scored"])
    return scored, figures["sequences"], figures["choices"], "computed"


def compute_reference(
    reference: Path, settings: dict[str, Any], threads: int, say: Progress
) -> dict[str, Any]:
    """Score the reference: its figures, each text's windows, greedy answers and choices."""
    say(f"loading reference {reference}")
    started = time.monotonic()
    loaded = load_candidate(reference, settings["device"], threads)
    windows = perplexities(loaded, settings["max_tokens"], settings["window"], say)
    sequences = greedy_sequences(loaded, settings["prompts"], settings["new_tokens"], say)
    choices = next_token_choices(loaded.model, sequences, say)
    scored = Scored(
        str(reference),
        loaded.kind,
        loaded.kernel,
        perplexity(windows["test"]),
        perplexity(windows["validation"]),
        settings["max_tokens"],
        time.monotonic() - started,
    )
    return {
        "scored": asdict(scored),
        "windows": windows,
        "sequences": sequences,
        "choices": choices,
    }


def format_report(report: QualityReport) -> str:
    rows = [report.checkpoint] + ([report.reference] if report.reference else [])
    width = max(len("checkpoint"), *(len(row.path) for row in rows))
    lines = [
        f"{'checkpoint':<{width}}  kind  {'kernel/dtype':<16}  ppl test  ppl validation  seconds"
    ]
    for row in rows:
        lines.append(
            f"{row.path:<{width}}  {row.kind:<4}  {row.kernel:<16}  {row.perplexity:>8.3f}"
            f"  {row.validation_perplexity:>14.3f}  {row.seconds:>7.1f}"
        )
    lines.append(
        f"texts: test {TEST_TEXT.name} (gated on), validation {VALIDATION_TEXT.name} (recipes are"
        f" chosen on it); {report.checkpoint.tokens} tokens each, {report.window}-token windows"
    )
    if report.ratio is not None and report.validation_ratio is not None:
        lines.append(
            f"perplexity ratio {report.ratio:.3f} on the test text"
            f" ({report.validation_ratio:.3f} on the validation text)"
        )
    if report.agreement is not None:
        lines.append(
            f"greedy agreement {report.agreement:.1%} "
            f"({report.agreed}/{report.compared} tokens over {report.prompts} prompts)"
        )
    return "\n".join(lines)


def print_progress(message: str) -> None:
    print(f"[evaluate] {message}", file=sys.stderr, flush=True)


def ship_reference(reference: Path, max_tokens: int, window: int, device: str, threads: int) -> int:
    """Score the fp source afresh and store its figures in the package."""
    import torch

    from predictor import toolchain

    settings = reference_settings(max_tokens, window, device=device)
    figures = compute_reference(reference, settings, threads, print_progress)
    key = reference_cache.cache_key(reference, TEXTS, settings)
    capability = torch.backends.cpu.get_cpu_capability()
    measured_on = f"{toolchain.cpu_model()}, torch {capability}, {threads} threads"
    print(f"wrote {reference_cache.ship(key, figures, measured_on)} ({measured_on})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m predictor.model.evaluate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("checkpoint", type=Path, help="GPTQ or fp checkpoint folder")
    parser.add_argument("--reference", type=Path, help="the fp checkpoint it was quantized from")
    parser.add_argument("--out", type=Path, help="write the figures to this JSON file")
    parser.add_argument(
        "--tokens", type=int, default=MAX_TOKENS, help="tokens to score on each text"
    )
    parser.add_argument("--window", type=int, default=WINDOW, help="tokens per forward pass")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--kernel",
        default="auto",
        help="GPTQ kernel: auto (the server's choice), fp32 (dequantized, fp32 compute), or a"
        " kernel name of the server's --kernel",
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="score the reference again, ignoring its cache"
    )
    parser.add_argument(
        "--ship-reference",
        action="store_true",
        help="score CHECKPOINT (the default model's fp32 source) as a reference and store its"
        f" figures in the package ({reference_cache.SHIPPED.name}), for every first build",
    )
    args = parser.parse_args(argv)
    prepare_environment(os.environ, Path.home() / ".cache" / "huggingface")
    if args.ship_reference:
        return ship_reference(args.checkpoint, args.tokens, args.window, args.device, args.threads)
    report = evaluate(
        args.checkpoint,
        args.reference,
        max_tokens=args.tokens,
        window=args.window,
        device=args.device,
        threads=args.threads,
        progress=print_progress,
        cache=not args.no_cache,
        kernel=args.kernel,
    )
    print(format_report(report))
    if args.out:
        args.out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
