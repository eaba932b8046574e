"""A build's heavy phases, each in a process of its own (predictor.model.isolated): the GPTQ
phase and the in-process gate of `make model` and of `quantize --source`. The build's own
process keeps only the orchestration (paths, figures, the served gate's client), so its peak
is the largest phase's, and the served gate's server starts beside a process that holds no
model. Progress comes back to the caller's Progress as each phase reports it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from predictor.model import isolated
from predictor.model.evaluate import QualityReport, evaluate
from predictor.model.progress import Progress, evaluation_steps
from predictor.model.recipe import DEFAULT_RECIPE, Recipe, quantize_checkpoint


def quantize(
    source: Path,
    out: Path,
    texts: Sequence[str],
    progress: Progress,
    threads: int,
    recipe: Recipe = DEFAULT_RECIPE,
    dtype: str = "auto",
    bits: int = 4,
    checkpoint_format: str = "gptq",
) -> list[dict[str, Any]]:
    """recipe.quantize_checkpoint in its own process; the modules' GPTQ losses."""
    losses: list[dict[str, Any]] = isolated.run(
        quantize_checkpoint,
        progress,
        threads,
        source=source,
        out=out,
        texts=list(texts),
        recipe=recipe,
        dtype=dtype,
        bits=bits,
        checkpoint_format=checkpoint_format,
    )
    return losses


def score(
    checkpoint: Path, reference: Path, progress: Progress, threads: int, **options: Any
) -> QualityReport:
    """evaluate.evaluate(checkpoint, reference, threads=threads, **options) in its own process,
    its messages shown as `progress`'s steps (evaluation_steps)."""
    report: QualityReport = isolated.run(
        _score,
        _Messages(progress),
        threads,
        checkpoint=checkpoint,
        reference=reference,
        threads=threads,
        options=options,
    )
    return report


class _Messages:
    """The parent's end of evaluate()'s progress: each message made a step of `progress`."""

    def __init__(self, progress: Progress) -> None:
        self.prefix = progress.prefix
        self.message = evaluation_steps(progress)


def _score(
    progress: Any, checkpoint: Path, reference: Path, threads: int, options: dict[str, Any]
) -> QualityReport:
    """In the phase's process: evaluate() with its messages relayed."""
    return evaluate(checkpoint, reference, threads=threads, progress=progress.message, **options)
