"""Checks of a user's own checkpoint for `quantize --source`: the source refused in a moment
when it cannot be quantized (before torch and any weight are loaded), and the built checkpoint
scored as the server runs it (its kernels) against the source, the last of the build's gates.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from predictor.errors import UnsupportedModel
from predictor.families import check_family
from predictor.model.gguf_source import is_gguf, read_gguf
from predictor.model.perplexity import TEXTS, sequence_perplexity, text_ids, tokens_available
from predictor.model.served import served_figures


def check_source(source: Path, group_size: int) -> dict[str, Any]:
    """The source's config (a checkpoint folder's config.json; a GGUF file's metadata as its
    model_type and widths), or SystemExit naming why it cannot be quantized: read in a
    moment, before any weight is."""
    if is_gguf(source):
        found = read_gguf(source)
        config = {
            "model_type": found.model_type,
            "hidden_size": found.hidden_size,
            "intermediate_size": found.intermediate_size,
        }
        _check_widths(source, config, group_size)
        return config
    config_file = source / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--source {source}: no readable config.json ({exc})") from exc
    try:
        check_family(str(config.get("model_type", "")))
    except UnsupportedModel as exc:
        raise SystemExit(f"--source {source}: {exc}") from exc
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise SystemExit(f"--source {source} is already quantized ({method}): give an fp one")
    if (
        not (source / "tokenizer.json").is_file()
        and not (source / "tokenizer_config.json").is_file()
    ):
        raise SystemExit(f"--source {source} has no tokenizer")
    _check_widths(source, config, group_size)
    return dict(config)


def _check_widths(source: Path, config: dict[str, Any], group_size: int) -> None:
    widths = {
        "hidden_size": config.get("hidden_size"),
        "intermediate_size": config.get("intermediate_size"),
    }
    for name, width in widths.items():
        if group_size > 0 and isinstance(width, int) and width % group_size:
            raise SystemExit(
                f"--group-size {group_size} does not divide {name} {width} of {source}"
            )


def has_chat_template(source: Path) -> bool:
    """Whether the source (a checkpoint folder, or a GGUF file) has a chat template: the
    build's agreement prompts are chat turns where it has one, plain text where not (a base
    model's), and a served model answers chat completions only with one."""
    if is_gguf(source):
        return read_gguf(source).chat_template
    if (source / "chat_template.jinja").is_file() or (source / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((source / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("chat_template")) if isinstance(config, dict) else False


SERVED_TOKENS = 1024  # of the test text, one context: what the served gate scores


def served_quality(
    checkpoint: Path,
    source: Path,
    threads: int,
    kernel: str | None = None,
    reference: float | None = None,
) -> dict[str, Any]:
    """The checkpoint's perplexity through the server (predictor.model.served: the autotune's
    kernels, or `kernel`) against the source's in process (`reference`, else computed), on the
    same tokens of the test text, and its decode tokens a second."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    context = int(
        json.loads((source / "config.json").read_text()).get("max_position_embeddings")
        or SERVED_TOKENS
    )
    count = min(SERVED_TOKENS, tokens_available(source), context // 2)
    ids = text_ids(tokenizer, TEXTS["test"], count)
    served = served_figures(checkpoint, ids, threads, kernel=kernel)
    if reference is None:
        reference = sequence_perplexity(source, ids, threads)
    return {
        "tokens": len(ids),
        "kernel": kernel or "auto",
        "perplexity": served["perplexity"],
        "reference": reference,
        "ratio": served["perplexity"] / reference,
        "tokens_per_second": served["tokens_per_second"],
    }


# fp32 activations in every fused projection: the precise kernel the served gate falls back to
# where the autotune's (int8 activations, on CPUs without bf16) lose too much
PRECISE_KERNEL = "native_f32"
Measure = Callable[[str | None, float | None], dict[str, Any]]


def served_gate(measure: Measure, max_ratio: float) -> tuple[dict[str, Any], str | None]:
    """The served gate: the autotune's kernels measured (`measure(kernel, reference)`); where
    they fail the bar, PRECISE_KERNEL's. Returns what quality.json records (`served`, and where
    the precise kernel was tried `served_precise`, and where it passed `serve`: the kernel the
    server is to run this checkpoint with, and what it costs in tokens a second) and why the
    gate refuses the build (None: it passes)."""
    served = measure(None, None)
    record: dict[str, Any] = {"served": served}
    if served["ratio"] <= max_ratio:
        return record, None
    precise = measure(PRECISE_KERNEL, served["reference"])
    record["served_precise"] = precise
    if precise["ratio"] <= max_ratio:
        record["serve"] = {
            "kernel": PRECISE_KERNEL,
            "reason": f"the autotune's kernels served ratio {served['ratio']:.3f}, past the bar "
            f"{max_ratio:.2f}; {PRECISE_KERNEL} {precise['ratio']:.3f}",
            "tokens_per_second": {
                "auto": served["tokens_per_second"],
                PRECISE_KERNEL: precise["tokens_per_second"],
            },
        }
        return record, None
    return record, (
        f"quality gate failed as served: ratio {served['ratio']:.3f} with the autotune's "
        f"kernels and {precise['ratio']:.3f} with {PRECISE_KERNEL}, past the bar {max_ratio:.2f}"
    )
