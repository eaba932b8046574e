"""Measure a checkpoint's quality before serving it: perplexity and greedy agreement.

`python -m predictor.model.evaluate CHECKPOINT [--reference SOURCE] [--out report.json]` scores any
GPTQ or plain (fp32/bf16) transformers checkpoint folder on the project's two evaluation texts,
both written for the project and never used for calibration: perplexity over the first 3,584
tokens of each in 512-token windows. The validation text (heldout.txt) is the one recipes are
chosen on; the test text (test.txt) is never used to choose anything, so its figure is the one
reported and gated on. With a reference (the fp model a GPTQ checkpoint was made from) it also
gives the ratio of the two perplexities on each text and the share of greedy next tokens that
agree on the reference's own greedy answers to a fixed set of chat prompts. The reference's
figures are cached in its folder (reference.json), so a second build does not compute them again,
and the default model source's ship with the package (predictor.model.reference_cache), so a
first build does not either.
"""

from __future__ import annotations

import argparse
import json
import math
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

VALIDATION_TEXT = Path(__file__).with_name("heldout.txt")  # recipes are chosen on this one
TEST_TEXT = Path(__file__).with_name("test.txt")  # never used to choose: reported and gated on
TEXTS = {"validation": VALIDATION_TEXT, "test": TEST_TEXT}
MAX_TOKENS = 3584
WINDOW = 512


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


def load_candidate(
    path: Path, device: str = "cpu", threads: int = 1, kernel: str = "auto"
) -> Candidate:
    """Load a GPTQ checkpoint, or an fp one in its stored dtype.

    `kernel` "auto" loads a GPTQ checkpoint the way the server does; "fp32" runs the whole model
    in fp32 on its dequantized 4-bit weights (on a CPU each Linear's made at its forward,
    predictor.model.streamed; elsewhere expanded once), like the fp32 reference: the figure
    then measures the quantization alone, and no bf16 path is taken (AVX2-only CPUs emulate
    bf16 matmuls, several times slower: predictor/model/precision.py).
    """
    import torch

    from predictor.model.loader import load_checkpoint, pick_device
    from predictor.model.streamed import KERNEL_NAME as STREAMED_KERNEL
    from predictor.model.streamed import load_streamed

    kind = checkpoint_kind(path)
    if kind == "gptq":
        if kernel == "fp32" and pick_device(device).type == "cpu":
            # each Linear's fp32 weight made at its forward, not the whole model's held
            # (predictor.model.streamed: the same numbers as the expansion below)
            streamed, tokenizer = load_streamed(path, threads)
            return Candidate(streamed, tokenizer, kind, STREAMED_KERNEL)
        if kernel == "fp32":
            loaded = load_checkpoint(path, device=device, threads=threads, kernel="dequantized")
            fp32 = torch.nn.Module.float(loaded.model)  # transformers' .float() refuses GPTQ
            return Candidate(fp32, loaded.tokenizer, kind, "Linear (fp32, dequantized)")
        loaded = load_checkpoint(path, device=device, threads=threads, kernel=kernel)
        return Candidate(loaded.model, loaded.tokenizer, kind, loaded.kernel)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    target = pick_device(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    model = model.to(target).eval()
    return Candidate(model, tokenizer, kind, str(model.dtype).removeprefix("torch."))


def sequence_perplexity(path: Path, ids: list[int], threads: int = 1) -> float:
    """A checkpoint's perplexity on ids[1:] in one forward over all of `ids` (fp: as stored;
    GPTQ: dequantized exactly, fp32)."""
    import torch

    loaded = load_candidate(path, "cpu", threads, "fp32")
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids])).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(float(nll))


def tokens_available(path: Path, max_tokens: int = MAX_TOKENS, window: int = WINDOW) -> int:
    """The evaluation length a checkpoint's tokenizer allows: `max_tokens`, or the whole windows
    its shortest text holds (a larger vocabulary than SmolLM2's makes the texts fewer tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    shortest = min(
        len(tokenizer(text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
        for text in TEXTS.values()
    )
    return min(max_tokens, shortest // window * window)


def text_ids(tokenizer: Any, path: Path, max_tokens: int = MAX_TOKENS) -> list[int]:
    """The first `max_tokens` token ids of an evaluation text; SystemExit when it is shorter."""
    text = path.read_text(encoding="utf-8")
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < max_tokens:
        raise SystemExit(f"{path} has {len(ids)} tokens, fewer than {max_tokens}")
    return ids[:max_tokens]


def perplexities(
    candidate: Candidate, max_tokens: int, window: int, progress: Progress
) -> dict[str, list[tuple[float, int]]]:
    """Each evaluation text's windows, by name: (summed next-token loss, tokens predicted)."""
    figures = {}
    for name, path in TEXTS.items():

        def say(message: str, name: str = name) -> None:
            progress(f"{name} text: {message}")

        ids = text_ids(candidate.tokenizer, path, max_tokens)
        figures[name] = window_losses(candidate.model, ids, window, say)
    return figures


def window_losses(
    model: Any, ids: Sequence[int], window: int, progress: Progress
) -> list[tuple[float, int]]:
    """Summed next-token loss and tokens predicted in each consecutive, non-overlapping window."""
    import torch

    device = next(model.parameters()).device
    losses = []
    starts = range(0, len(ids) - 1, window)
    for number, start in enumerate(starts, 1):
        chunk = torch.tensor([ids[start : start + window]], device=device)  # [1, S]
        if chunk.shape[1] < 2:
            break
        progress(f"perplexity window {number}/{len(starts)}")
        with torch.inference_mode():
            logits = model(input_ids=chunk).logits[0, :-1].float()  # [S-1, V]
        loss = torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum")
        losses.append((float(loss), chunk.shape[1] - 1))
    return losses


def perplexity(windows: Sequence[tuple[float, int]]) -> float:
    """exp(mean next-token loss) over the windows."""
    return math.exp(sum(loss for loss, _ in windows) / sum(count for _, count in windows))


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
