"""The running batch: one Sequence per request holding KV-cache blocks, prefilling or decoding."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from predictor.engine.detokenizer import IncrementalDetokenizer
from predictor.types import FinishReason, SamplingParams, TokenEvent, TokenLogprob, Usage

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
    matcher: Any = None  # engine.grammar.Matcher when the request has a grammar
    deadline: float | None = None  # time.monotonic() after which the request times out
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    aborted: bool = False
    finish_reason: FinishReason | None = None
    blocks: list[int] = field(default_factory=list)  # KV-cache block table, in position order
    reserved_blocks: int = 0  # blocks promised to this row at admission
    cached: int = 0  # tokens whose keys and values the cache holds

    @property
    def budget_tokens(self) -> int:
        """Cache tokens this request may need at most."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def prefilling(self) -> bool:
        return self.cached < len(self.prompt_ids)

    @property
    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt_ids), generated_tokens=len(self.output_ids))

    def emit(
        self, text: str, token_ids: tuple[int, ...] = (), logprobs: tuple[TokenLogprob, ...] = ()
    ) -> None:
        self.sink(TokenEvent(self.request_id, text, token_ids, logprobs=logprobs))

    def finish(
        self,
        reason: FinishReason,
        text: str = "",
        error: str | None = None,
        token_ids: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        """Send the final event (once)."""
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        self.sink(TokenEvent(self.request_id, text, token_ids, reason, self.usage, error, logprobs))


class Batch:
    """Sequences admitted to the cache, oldest first."""

    def __init__(self) -> None:
        self.rows: list[Sequence] = []

    def __len__(self) -> int:
        return len(self.rows)

    def extend(self, seqs: list[Sequence]) -> None:
        self.rows.extend(seqs)

    def remove_finished(self) -> list[Sequence]:
        """Drop finished rows; return them."""
        gone = [seq for seq in self.rows if seq.finish_reason is not None]
        if gone:
            self.rows = [seq for seq in self.rows if seq.finish_reason is None]
        return gone
