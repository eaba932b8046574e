"""The running batch: one Sequence per request holding KV-cache blocks, prefilling or decoding."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from predictor.engine.detokenizer import IncrementalDetokenizer
from predictor.engine.kv_cache import BlockKey, extend_keys
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
    cached: int = 0  # tokens whose keys and values the cache holds (of prompt + output)
    cache_salt: str | None = None  # prefix-cache extras: requests with other salts never share
    keys: list[BlockKey] = field(default_factory=list)  # prefix-cache keys of full blocks
    registered: int = 0  # leading blocks of `blocks` offered to the prefix cache
    cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    preemptions: int = 0  # times this row gave its blocks back to be recomputed later

    @property
    def total_tokens(self) -> int:
        """Tokens the row's cache must hold to sample its next token: prompt + output."""
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        prompt = len(self.prompt_ids)
        if end <= prompt:
            return self.prompt_ids[start:end]
        if start >= prompt:
            return self.output_ids[start - prompt : end - prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - prompt]

    def block_keys(self, count: int, block_size: int) -> list[BlockKey]:
        """Prefix-cache keys of the first `count` full blocks of prompt + output."""
        extend_keys(self.keys, self.tokens, count, block_size, self.cache_salt)
        return self.keys[:count]

    @property
    def prefilling(self) -> bool:
        """More than the last sampled token to feed: a prompt (or, after a preemption, prompt
        and output) still going through the model."""
        return self.cached < self.total_tokens - 1 or not self.output_ids

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=len(self.prompt_ids),
            generated_tokens=len(self.output_ids),
            cached_tokens=self.cached_prompt_tokens,
        )

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
