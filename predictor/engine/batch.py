"""The running batch: one Sequence per request, in the same order as the runner's cache rows."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from predictor.engine.detokenizer import IncrementalDetokenizer
from predictor.types import FinishReason, SamplingParams, TokenEvent, Usage

EventSink = Callable[[TokenEvent], None]


@dataclass(eq=False)
class Sequence:
    """All state of one request inside the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    sink: EventSink
    generator: Any = None  # torch.Generator, made by the step loop when the row is admitted
    deadline: float | None = None  # time.monotonic() after which the request times out
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    aborted: bool = False
    finish_reason: FinishReason | None = None

    @property
    def budget_tokens(self) -> int:
        """Cache tokens this request may need at most."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt_ids), generated_tokens=len(self.output_ids))

    def emit(self, text: str, token_ids: tuple[int, ...] = ()) -> None:
        self.sink(TokenEvent(self.request_id, text, token_ids))

    def finish(
        self,
        reason: FinishReason,
        text: str = "",
        error: str | None = None,
        token_ids: tuple[int, ...] = (),
    ) -> None:
        """Send the final event (once)."""
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        self.sink(TokenEvent(self.request_id, text, token_ids, reason, self.usage, error))


class Batch:
    """Sequences holding a row of the shared cache; row i of the runner is `rows[i]`."""

    def __init__(self) -> None:
        self.rows: list[Sequence] = []

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def budget_tokens(self) -> int:
        return sum(seq.budget_tokens for seq in self.rows)

    def extend(self, seqs: list[Sequence]) -> None:
        self.rows.extend(seqs)

    def remove_finished(self) -> list[int] | None:
        """Drop finished rows; return the indices kept (None when nothing changed)."""
        kept = [i for i, seq in enumerate(self.rows) if seq.finish_reason is None]
        if len(kept) == len(self.rows):
            return None
        self.rows = [self.rows[i] for i in kept]
        return kept
