"""One request inside the engine: its tokens, its KV-cache blocks, its events."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from predictor.engine.detokenizer import IncrementalDetokenizer
from predictor.engine.kv_cache import BlockKey, extend_keys
from predictor.engine.kv_events import BlockHash
from predictor.engine.reasoning import Thinking
from predictor.engine.speculation import RowSpeculation
from predictor.types import (
    FinishReason,
    PromptEcho,
    PromptToken,
    RequestTimes,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    Usage,
)

EventSink = Callable[[TokenEvent], None]


@dataclass(eq=False)
class Request:
    """All state of one request inside the engine (vLLM's `Request`)."""

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
    # only the prompt is wanted (max_tokens 0: its echo, its scores): no token is sampled
    echo_only: bool = False
    finish_reason: FinishReason | None = None
    blocks: list[int] = field(default_factory=list)  # KV-cache block table, in position order
    cached: int = 0  # tokens whose keys and values the cache holds (of prompt + output)
    cache_salt: str | None = None  # prefix-cache extras: requests with other salts never share
    adapter: int = 0  # its LoRA adapter's slot in the runner (0: the base model); blocks
    # computed under one adapter are never shared with another's rows (a prefix-cache extra)
    lora_name: str | None = None  # its adapter's name (KV events carry it)
    keys: list[BlockKey] = field(default_factory=list)  # prefix-cache keys of full blocks
    # KV events: vLLM's hashes of its full blocks, computed once each (only when events are on)
    event_hashes: list[BlockHash] = field(default_factory=list)
    registered: int = 0  # leading blocks of `blocks` offered to the prefix cache
    cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    preemptions: int = 0  # times this row gave its blocks back to be recomputed later
    scheduled: float | None = None  # when it first got a row (time.monotonic)
    preempted_at: list[float] = field(default_factory=list)  # when it gave its blocks back
    # echo: the prompt's text, sent back on the first event (with prompt_scores, if scored)
    prompt_text: str | None = None
    # prompt_logprobs: one entry per prompt token scored so far (the first has no logprob)
    prompt_scores: list[PromptToken] = field(default_factory=list)
    prompt_sent: bool = False  # the first event (carrying the prompt, if asked) went out
    # speculative decoding: the row's drafting state (None: it never drafts), and its totals
    speculation: RowSpeculation | None = None
    draft_tokens: int = 0  # drafted and verified
    accepted_tokens: int = 0  # of them, kept
    # a thinking model's chat request: its thinking followed, its text split (engine/reasoning)
    thinking: Thinking | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_ids:
            first = self.prompt_ids[0]
            self.prompt_scores.append(PromptToken(first, self.detokenizer.token_text(first), None))

    def follow_thinking(self, token: int) -> None:
        """One kept token of a thinking model: its grammar waits while it thinks."""
        assert self.thinking is not None
        opened = self.thinking.state is None
        ended = self.thinking.observe(token)
        if opened and self.matcher is not None:  # the first token: the grammar's own from now
            inner = getattr(self.matcher, "inner", self.matcher)
            if self.thinking.state:  # it opened a thinking: the grammar waits for its end
                self.thinking.pending, self.matcher = inner, None
            else:
                self.matcher = inner
        elif ended and self.thinking.pending is not None:
            self.matcher, self.thinking.pending = self.thinking.pending, None

    @property
    def scoring(self) -> bool:
        """Prompt tokens are still to be scored: every prefill chunk needs all its logits,
        and no cached prefix may stand in for the positions that score them."""
        return self.params.prompt_logprobs is not None and len(self.prompt_scores) < len(
            self.prompt_ids
        )

    def _prompt(self) -> PromptEcho | None:
        """The prompt for the first event, when the request asked for it (once)."""
        if self.prompt_sent:
            return None
        self.prompt_sent = True
        if self.prompt_text is None and self.params.prompt_logprobs is None:
            return None
        return PromptEcho(self.prompt_text or "", tuple(self.prompt_ids), tuple(self.prompt_scores))

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
        extras = (self.cache_salt, self.adapter) if self.adapter else self.cache_salt
        extend_keys(self.keys, self.tokens, count, block_size, extras)
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
            draft_tokens=self.draft_tokens,
            accepted_draft_tokens=self.accepted_tokens,
            reasoning_tokens=0 if self.thinking is None else self.thinking.tokens,
        )

    def emit(
        self, text: str, token_ids: tuple[int, ...] = (), logprobs: tuple[TokenLogprob, ...] = ()
    ) -> None:
        first = not self.prompt_sent
        reasoning = ""
        if self.thinking is not None:
            reasoning, text = self.thinking.splitter.feed(text)
        self.sink(
            TokenEvent(
                self.request_id,
                text,
                token_ids,
                logprobs=logprobs,
                prompt=self._prompt(),
                first_usage=self.usage if first else None,
                reasoning=reasoning,
            )
        )

    def finish(
        self,
        reason: FinishReason,
        text: str = "",
        error: str | None = None,
        token_ids: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (),
        error_param: str | None = None,
        stop_sequence: str | None = None,
    ) -> None:
        """Send the final event (once). `error_param`: the request's parameter to blame;
        `stop_sequence`: the stop string that ended the text (FinishReason.STOP)."""
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        prompt = self._prompt() if error is None else None
        reasoning = ""
        if self.thinking is not None:
            reasoning, text = self.thinking.splitter.feed(text)
            held, rest = self.thinking.splitter.flush()
            reasoning, text = reasoning + held, text + rest
        self.sink(
            TokenEvent(
                self.request_id,
                text,
                token_ids,
                reason,
                self.usage,
                error,
                logprobs,
                prompt,
                error_param,
                RequestTimes(self.arrival, self.scheduled, tuple(self.preempted_at)),
                stop_sequence,
                reasoning=reasoning,
            )
        )
