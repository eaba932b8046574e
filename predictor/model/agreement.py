"""Greedy agreement: the reference's greedy answers to fixed chat prompts, and the next tokens a
checkpoint would choose at each of their positions (predictor.model.evaluate compares the two).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

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


class Loaded(Protocol):
    """A loaded checkpoint (perplexity.Candidate): its transformers model and tokenizer."""

    @property
    def model(self) -> Any: ...

    @property
    def tokenizer(self) -> Any: ...


def greedy_sequences(
    candidate: Loaded, prompts: Sequence[str], new_tokens: int, progress: Progress
) -> list[tuple[list[int], int]]:
    """The model's greedy answer to each chat prompt: (prompt + answer ids, prompt length).
    Chat turns through the tokenizer's chat template; without one (a base model), plain text.

    The prompts are answered in one left-padded batch: each of the `new_tokens` steps reads the
    weights once for all of them, with the same tokens as one by one
    (tests/model/test_evaluate.py). A row's answer ends at its first
    end-of-sequence token, as a generate call of its own would stop there.
    """
    import torch

    model, tokenizer = candidate.model, candidate.tokenizer
    progress(f"greedy answers to {len(prompts)} prompts, in one batch")
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    pad = tokenizer.pad_token
    try:
        if getattr(tokenizer, "chat_template", None):
            inputs = tokenizer.apply_chat_template(
                [[{"role": "user", "content": prompt}] for prompt in prompts],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=True,
                padding=True,
            )
        else:  # a base model's: the prompts as plain text
            tokenizer.pad_token = pad or tokenizer.eos_token
            inputs = tokenizer(list(prompts), return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side, tokenizer.pad_token = side, pad
    inputs = inputs.to(next(model.parameters()).device)
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
    stops = _eos_ids(model)
    width = int(inputs["input_ids"].shape[1])
    sequences = []
    for row, mask in zip(out.tolist(), inputs["attention_mask"].tolist(), strict=True):
        prompt = row[width - sum(mask) : width]
        answer = row[width:]
        ends = [i for i, token in enumerate(answer) if token in stops]
        sequences.append((prompt + answer[: ends[0] + 1 if ends else None], len(prompt)))
    return sequences


def _eos_ids(model: Any) -> set[int]:
    """The tokens `generate` stops at: its generation config's alone (the server's own set,
    loader._eos_ids, also takes the config's and the tokenizer's)."""
    value = model.generation_config.eos_token_id
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list | tuple) else {int(value)}


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
