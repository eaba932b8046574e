"""What one forward pass is made of, and the face every runner shows the step loop.

No torch here (only `engine/runners/` and `engine/sampling.py` import it at run time): the step
loop, the scheduler's tests and the null runner share these types without loading a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only
    import torch


@dataclass
class StepRow:
    """One row's part of a forward pass."""

    blocks: Sequence[int]  # the row's block table, covering positions [0, start + len(tokens))
    start: int  # position of tokens[0]: how many of the row's tokens the cache already holds
    tokens: Sequence[int]  # fed this step: 1 for a decode row, a prompt chunk for a prefill row
    logits: bool  # whether the step must return logits for the last of `tokens`
    # logits for every one of `tokens` (a prompt being scored, prompt_logprobs): len(tokens)
    # rows, the last of them the one `logits` asks for; rows without it cost nothing extra
    all_logits: bool = False

    @property
    def logit_count(self) -> int:
        """Rows of logits the step returns for this row."""
        return len(self.tokens) if self.all_logits else int(self.logits)


class Runner(Protocol):
    device: torch.device

    def bind_thread(self) -> None: ...

    def forward(self, rows: Sequence[StepRow]) -> torch.Tensor:
        """logits: [sum of the rows' logit_count, vocab], in the order of `rows` (a row with
        all_logits: one per token it was fed, in position order)."""
        ...
