"""A checkpoint's perplexity on the project's two evaluation texts.

Both texts were written for the project and are never used for calibration: the validation text
(heldout.txt) is the one recipes are chosen on; the test text (test.txt) is never used to choose
anything, so its figure is the one reported and gated on. A checkpoint (GPTQ or plain fp32/bf16
transformers, `load_candidate`) is scored over the first 3,584 tokens of each in 512-token
windows: exp of the mean next-token loss. The quality report that compares two checkpoints
(perplexity ratio, greedy agreement) is `evaluate.py`'s.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from predictor.model.agreement import Progress

VALIDATION_TEXT = Path(__file__).with_name("heldout.txt")  # recipes are chosen on this one
TEST_TEXT = Path(__file__).with_name("test.txt")  # never used to choose: reported and gated on
TEXTS = {"validation": VALIDATION_TEXT, "test": TEST_TEXT}
MAX_TOKENS = 3584
WINDOW = 512


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
