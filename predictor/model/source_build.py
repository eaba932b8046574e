"""`python -m predictor.model.quantize --source`: a user's own checkpoint folder or GGUF file
built into a GPTQ checkpoint: checked in a moment, (a GGUF dequantized first), quantized,
scored in process and as served, and installed, or kept at OUT.rejected where a gate refuses
it (builds.py). The dequantization, the GPTQ phase, the in-process gate and each served
measurement run in a process of their own (phases.py, isolated.py), so the build's peak
memory is its largest phase's."""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TextIO

from predictor.model import isolated
from predictor.model import phases as phases_
from predictor.model.builds import (
    QUALITY_FILE,
    WORST_MODULES,
    install,
    keep_rejected,
    quality_refusal,
    worst_modules,
    write_report,
)
from predictor.model.env import cpu_name
from predictor.model.evaluate import format_report
from predictor.model.gguf_source import export_gguf, is_gguf, read_gguf
from predictor.model.perplexity import tokens_available
from predictor.model.precision import calibration_dtype
from predictor.model.progress import Progress, format_duration, timed_phase
from predictor.model.recipe import Recipe, source_texts
from predictor.model.source_checks import (
    SERVED_TOKENS,
    check_source,
    has_chat_template,
    served_gate,
    served_quality,
)


def build_from_source(
    source: Path,
    out: Path,
    threads: int,
    max_ratio: float,
    recipe: Recipe,
    bits: int = 4,
    console: TextIO | None = None,
    dtype: str = "auto",
    checkpoint_format: str = "gptq",
) -> None:
    """A user's fp checkpoint folder or GGUF file to GPTQ at `out`: quantize, score against the
    source, gate, install (with quality.json), each phase shown with its progress. A build a
    gate refuses is kept at OUT.rejected with its report (builds.py)."""
    progress = Progress(console or sys.stdout, prefix="[quantize]  ")
    config = check_source(source, recipe.group_size)
    templated = has_chat_template(source)
    started = time.monotonic()
    phases: dict[str, float] = {}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gptq-build-", dir=out.parent) as tmp:
        staged, fp_source = Path(tmp) / "gptq", source
        if is_gguf(source):
            fp_source = Path(tmp) / "source"
            found = read_gguf(source)
            progress.say(
                f"[quantize] dequantizing {source.name} ({found.model_type}, "
                f"{found.file_type}) to a bf16 checkpoint, the build's source"
            )
            with timed_phase(phases, "dequantize", progress, Path(tmp) / "dequantize.log"):
                isolated.run(export_gguf, None, threads, path=source, out=fp_source)
        if not templated:
            progress.say(
                f"[quantize] {source} has no chat template (a base model): the "
                "agreement prompts are scored as plain text"
            )
        every_text = source_texts()
        texts = recipe.pick(every_text)
        dtype, why = calibration_dtype(fp_source, dtype)
        progress.say(
            f"[quantize] 1/3 GPTQ {bits}-bit ({checkpoint_format}) of {source} "
            f"({config['model_type']}), "
            f"{recipe.describe()}, {len(texts)} of {len(every_text)} calibration texts, "
            f"{dtype} forwards ({why}), {threads} threads"
        )
        with timed_phase(phases, "quantize", progress, out.parent / "quantize.log"):
            losses = phases_.quantize(
                fp_source,
                staged,
                texts,
                progress,
                threads,
                recipe=recipe,
                dtype=dtype,
                bits=bits,
                checkpoint_format=checkpoint_format,
            )
        progress.say(f"[quantize] 2/3 quality against {source} (bar: test ratio <= {max_ratio})")
        with timed_phase(phases, "evaluate", progress, Path(tmp) / "evaluate.log"):
            report = phases_.score(
                staged,
                fp_source,
                progress,
                threads,
                kernel="fp32",
                max_tokens=tokens_available(fp_source),
            )
        report = replace(report, checkpoint=replace(report.checkpoint, path=str(out)))
        if report.reference is not None:  # the GGUF, not the folder it was dequantized to
            report = replace(report, reference=replace(report.reference, path=str(source)))
        for line in format_report(report).splitlines():
            progress.say(f"[quantize]     {line}")
        build = {
            "source": str(source),
            "bits": bits,
            "format": checkpoint_format,
            "recipe": asdict(recipe),
            "calibration_dtype": dtype,
            "dtype_choice": why,
            "threads": threads,
            "cpu": cpu_name(),
            "agreement_prompts": "chat" if templated else "plain text",
            "worst_modules": losses[:WORST_MODULES],
        }
        quality: dict[str, Any] = {**report.to_json(), "build": build}
        refusal = quality_refusal(report, max_ratio)
        if refusal is None:
            progress.say(
                f"[quantize] 3/3 quality as served: the server's kernels on "
                f"{SERVED_TOKENS} tokens of the test text, against the source"
            )

            def measure(kernel: str | None, reference: float | None) -> dict[str, Any]:
                # in a process of its own too: the server starts beside a builder that holds
                # no model, and the source's own perplexity is computed there after it stops
                figures: dict[str, Any] = isolated.run(
                    served_quality,
                    None,
                    threads,
                    checkpoint=staged,
                    source=fp_source,
                    threads=threads,
                    kernel=kernel,
                    reference=reference,
                )
                progress.say(
                    f"[quantize]     served ({figures['kernel']} kernels) perplexity "
                    f"{figures['perplexity']:.3f} / source {figures['reference']:.3f}"
                    f" = ratio {figures['ratio']:.3f}, "
                    f"{figures['tokens_per_second']:.1f} tokens/s"
                )
                return figures

            with timed_phase(phases, "served", progress, Path(tmp) / "served.log"):
                record, refusal = served_gate(measure, max_ratio)
            quality.update(record)
            if "serve" in record:
                progress.say(
                    f"[quantize]     to be served with --kernel "
                    f"{record['serve']['kernel']} (recorded in {QUALITY_FILE}; "
                    f"--kernel overrides): {record['serve']['reason']}"
                )
        build["seconds"] = {**phases, "total": time.monotonic() - started}
        if refusal is not None:
            kept = keep_rejected(staged, out, quality, refusal)
            raise SystemExit(
                f"{refusal}; the checkpoint was not installed. Kept with its report at {kept} "
                f"(lost the most: {worst_modules(losses) or 'not recorded'}); install it as it "
                f"is with --accept-rejected {kept}"
            )
        write_report(staged, quality)
        install(staged, out)
    progress.say(
        f"[quantize] wrote {out} in {format_duration(time.monotonic() - started)} on "
        f"{cpu_name()}, {threads} threads"
    )
