"""The step loop: one thread that runs the batch one token at a time.

Each step: retire aborted and timed-out rows, admit waiting requests (each takes its cached
prefix and blocks for the rest of its prompt), give each decoding row the block its next token
needs (preempting the most recently admitted rows when the cache is dry), then run one forward
pass that feeds every decoding row its last token and the prefilling rows the next chunks of
their prompts, within a per-step token budget (chunked prefill: a long prompt never stalls the
running streams for more than a chunk), sample the rows that got logits, send each row its
event and offer the blocks that filled up to the prefix cache. This is the only loop over the
batch, and the only code that calls the runner.

Preemption by recompute (vLLM's): a preempted row gives back its blocks and goes back to the
head of the queue with its output so far; readmitted, it prefills prompt + output (mostly from
its own blocks, still cached unless evicted) and samples on from where it stopped, with the
same generator, so its stream neither repeats nor loses a token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from predictor.engine.batch import Batch, Sequence
from predictor.engine.kv_cache import BlockAllocator
from predictor.engine.sampling import (
    NO_TOKEN_ALLOWED,
    make_generator,
    sample,
    score_tokens,
    select_rows,
)
from predictor.engine.scheduler import Scheduler
from predictor.engine.step import Runner, StepRow
from predictor.types import FinishReason, PromptToken, TokenLogprob, TopLogprob

if TYPE_CHECKING:  # annotations only: the runners run torch
    import torch

log = logging.getLogger(__name__)


class StepLoop:
    def __init__(
        self,
        runner: Runner,
        scheduler: Scheduler,
        eos_ids: Collection[int],
        allocator: BlockAllocator,
        max_step_tokens: int = 256,
        clock: Callable[[], float] = time.monotonic,
        on_step: Callable[[int], None] | None = None,
        on_admit: Callable[[float], None] | None = None,
        prefix_caching: bool = True,
        on_prefix_cache: Callable[[int, int], None] | None = None,
        on_preempt: Callable[[], None] | None = None,
        on_prepared: Callable[[], None] | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.batch = Batch()
        self.allocator = allocator
        self.max_step_tokens = max_step_tokens
        self._eos_ids = frozenset(eos_ids)
        self._clock = clock
        self._on_step = on_step  # called with the number of rows that got a token, each step
        self._on_admit = on_admit  # called with each admitted request's waiting time
        self.prefix_caching = prefix_caching
        # called at each request's first admission with (prompt tokens, of them cached)
        self._on_prefix_cache = on_prefix_cache
        self._on_preempt = on_preempt  # called once per preemption
        self._on_prepared = on_prepared  # called once, on this thread, when ready
        # called on this thread after each step: AsyncEngine hands the step's events to asyncio
        # in one batch there (one wake-up of the event loop per step, not one per row)
        self.after_step: Callable[[], None] | None = None
        # when the last step (or idle wait) ended, for liveness: rows running and no step done
        # for a long time means a hung kernel
        self.last_progress = clock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        # set once the runner is bound to this thread (its kernels compiled and tuned): until
        # then the engine is not ready, so a first request is not sent to wait out the autotune
        self.prepared = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle (called from the asyncio side) -------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos_ids

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def notify(self) -> None:
        self._wake.set()

    # -- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        self.runner.bind_thread()
        self.last_progress = self._clock()
        self.prepared.set()
        if self._on_prepared is not None:
            self._on_prepared()
        while not self._stopping.is_set():
            if not self.batch and not self.scheduler.waiting():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                self.last_progress = self._clock()
                continue
            try:
                self.step()
            except Exception:  # a bug here must not kill the engine
                log.exception("engine step failed")
                self._fail_all("engine step failed")
            self.last_progress = self._clock()
            self._after_step()
        self._fail_all("engine stopped")
        for seq in self.scheduler.drain():
            seq.finish(FinishReason.ERROR, error="engine stopped")
        self._after_step()

    def _after_step(self) -> None:
        if self.after_step is not None:
            self.after_step()

    def step(self) -> None:
        self._retire()
        try:
            self._admit()
        except Exception:  # the running rows go on, untouched
            log.exception("admitting new requests failed")
        if self.batch:
            self._forward()

    def _retire(self) -> None:
        for seq in self.scheduler.drop_aborted():
            seq.finish(FinishReason.CANCELLED)
        now = self._clock()
        for seq in self.scheduler.drop_expired(now):  # not running (never, or preempted)
            seq.finish(FinishReason.TIMEOUT, seq.detokenizer.flush() if seq.output_ids else "")
        for seq in self.batch.rows:
            if seq.aborted:
                seq.finish(FinishReason.CANCELLED, seq.detokenizer.flush())
            elif seq.deadline is not None and now >= seq.deadline:
                seq.finish(FinishReason.TIMEOUT, seq.detokenizer.flush())
        self._compact()

    def _admit(self) -> None:
        admitted = self.scheduler.admit(len(self.batch), self.allocator, self.prefix_caching)
        if not admitted:
            return
        now = self._clock()
        joined = []
        for seq in admitted:
            if seq.preemptions:  # resumed: its generator, queue time and cache query stand
                joined.append(seq)
                continue
            try:
                seq.generator = make_generator(seq.params.seed, self.runner.device)
                seq.scheduled = now
                if self._on_admit is not None:
                    self._on_admit(now - seq.arrival)
                if self._on_prefix_cache is not None and self.prefix_caching:
                    self._on_prefix_cache(len(seq.prompt_ids), seq.cached_prompt_tokens)
            except Exception:  # fails this request only; its reservation goes back
                log.exception("admitting request %s failed", seq.request_id)
                seq.finish(FinishReason.ERROR, error="the request could not be admitted")
                self._free(seq)
                continue
            if seq.params.max_tokens == 0 and not seq.scoring:  # echo only: nothing to run
                seq.finish(FinishReason.LENGTH)
                self._free(seq)
                continue
            joined.append(seq)
        self.batch.extend(joined)

    def _grow(self) -> None:
        """Give each decoding row, oldest first, the block its next token needs; when none is
        available, preempt the most recently admitted row (the row itself, if it is that)."""
        rows = self.batch.rows
        size = self.allocator.block_size
        i = 0
        while i < len(rows):
            seq = rows[i]
            if seq.cached < len(seq.blocks) * size:  # prompts got their blocks at admission
                i += 1
                continue
            while not self.allocator.available and rows[-1] is not seq:
                self._preempt(rows[-1])
            if not self.allocator.available:
                self._preempt(seq)
                continue
            after = seq.blocks[-1] if seq.blocks else None
            seq.blocks.extend(self.allocator.allocate(1, after))
            i += 1

    def _preempt(self, seq: Sequence) -> None:
        """Take the row out of the batch, free its blocks and queue it to be recomputed."""
        self.batch.rows.remove(seq)
        self._free(seq)
        seq.cached = seq.registered = 0
        seq.preemptions += 1
        seq.preempted_at.append(self._clock())
        self.scheduler.requeue(seq)
        if self._on_preempt is not None:
            self._on_preempt()

    def _plan(self) -> tuple[list[Sequence], list[StepRow]]:
        """Who is fed what this step: every decoding row one token, then prompt chunks."""
        fed: list[Sequence] = []
        rows: list[StepRow] = []
        budget = self.max_step_tokens
        prefilling = []
        for seq in self.batch.rows:
            if seq.prefilling:
                prefilling.append(seq)
                continue
            fed.append(seq)
            rows.append(StepRow(seq.blocks, seq.cached, seq.output_ids[-1:], logits=True))
            budget -= 1
        for seq in prefilling:
            if budget <= 0 and rows:
                break
            total = seq.total_tokens
            end = min(total, seq.cached + max(budget, 1))
            chunk = seq.tokens(seq.cached, end)
            budget -= len(chunk)
            fed.append(seq)
            sample_next = end == total and seq.params.max_tokens > 0
            rows.append(StepRow(seq.blocks, seq.cached, chunk, sample_next, seq.scoring))
        return fed, rows

    def _register(self, seq: Sequence) -> None:
        """Offer the row's blocks that are full and computed to the prefix cache."""
        size = self.allocator.block_size
        full = seq.cached // size
        if seq.registered < full:
            keys = seq.block_keys(full, size)
            for i in range(seq.registered, full):
                self.allocator.register(seq.blocks[i], keys[i])
            seq.registered = full

    def _forward(self) -> None:
        self._grow()
        fed, rows = self._plan()
        if not rows:  # every row was preempted
            return
        try:
            logits = self.runner.forward(rows)
        except Exception:  # the detail goes to the log, a short message to the clients
            log.exception("forward pass failed")
            for seq in fed:  # their cache contents are unknown now; rows not fed are intact
                seq.finish(FinishReason.ERROR, error="forward pass failed")
            self._compact()
            return
        sampled = []
        at: list[int] = []  # the rows of `logits` sampled from
        first = 0  # the row of `logits` where this row's begin
        for seq, row in zip(fed, rows, strict=True):
            if row.all_logits:
                self._score(seq, row, logits[first : first + len(row.tokens)])
            seq.cached += len(row.tokens)
            if self.prefix_caching:
                self._register(seq)
            first += row.logit_count
            if row.logits:
                sampled.append(seq)
                at.append(first - 1)
            elif seq.params.max_tokens == 0 and seq.cached >= len(seq.prompt_ids):
                seq.finish(FinishReason.LENGTH)  # echo only: the prompt is scored
        if sampled:
            self._accept(sampled, select_rows(logits, at))
        if self._on_step is not None and sampled:
            self._on_step(len(sampled))
        self._compact()

    def _accept(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        # logits: [len(seqs), V]
        try:
            result = sample(logits, seqs, self._eos_ids)
        except Exception:  # a sampling bug must fail these rows, not the engine
            log.exception("sampling failed")
            for seq in seqs:
                seq.finish(FinishReason.ERROR, error="sampling failed")
            return
        for seq, token, logprob in zip(seqs, result.tokens, result.logprobs, strict=True):
            if token == NO_TOKEN_ALLOWED and seq.params.grammar is not None:
                param = seq.params.grammar.param  # the request's constraint, not the model
                seq.finish(FinishReason.ERROR, seq.detokenizer.flush(), error_param=param,
                           error=f"no text satisfies '{param}' past what was generated: it "
                           "allows no next token")  # fmt: skip
                continue
            if token < 0:
                seq.finish(FinishReason.ERROR, error="the model produced non-finite logits")
                continue
            logprobs: tuple[TokenLogprob, ...] = ()
            if logprob is not None:
                logprobs = (self._token_logprob(seq, token, *logprob),)
            self._advance(seq, token, logprobs)

    @staticmethod
    def _score(seq: Sequence, row: StepRow, logits: torch.Tensor) -> None:
        """Score the prompt tokens that follow this chunk's positions (logits [len(tokens),
        V]: position start + i's), skipping those scored before a preemption."""
        scores = seq.prompt_scores
        skip = len(scores) - 1 - row.start  # positions already scored
        targets = seq.prompt_ids[len(scores) : row.start + len(row.tokens) + 1]
        if skip < 0 or not targets:
            return
        k = seq.params.prompt_logprobs or 0
        text = seq.detokenizer.token_text
        scored = score_tokens(logits[skip : skip + len(targets)], targets, k)
        for token, (logprob, rank, top) in zip(targets, scored, strict=True):
            tops = tuple(TopLogprob(t, text(t), lp) for t, lp in top)
            scores.append(PromptToken(token, text(token), logprob, rank, tops))

    @staticmethod
    def _token_logprob(
        seq: Sequence, token: int, logprob: float, top: list[tuple[int, float]]
    ) -> TokenLogprob:
        text = seq.detokenizer.token_text
        return TokenLogprob(
            token, text(token), logprob, tuple(TopLogprob(t, text(t), lp) for t, lp in top)
        )

    def _advance(self, seq: Sequence, token: int, logprobs: tuple[TokenLogprob, ...]) -> None:
        seq.output_ids.append(token)
        ids = (token,)
        generated = len(seq.output_ids)
        # min_tokens (vLLM's meaning): eos may end the request only after that many tokens,
        # stop strings are looked for once that many exist
        eos_armed = generated > seq.params.min_tokens and not seq.params.ignore_eos
        matcher = seq.matcher
        if matcher is not None:  # the grammar says when the text ends: eos is its end
            if not matcher.accept(token):
                seq.finish(FinishReason.ERROR, error="the grammar refused the sampled token")
                return
            eos_armed = True
        if token in self._eos_ids and eos_armed:
            seq.finish(FinishReason.EOS, seq.detokenizer.flush(), token_ids=ids, logprobs=logprobs)
            return
        text = seq.detokenizer.push(token, check_stop=generated >= seq.params.min_tokens)
        if matcher is not None and not seq.detokenizer.stopped and matcher.finished:
            text += seq.detokenizer.flush()
            seq.finish(FinishReason.EOS, text, token_ids=ids, logprobs=logprobs)
        elif seq.detokenizer.stopped:
            seq.finish(FinishReason.STOP, text, token_ids=ids, logprobs=logprobs)
        elif generated >= seq.params.max_tokens:
            text += seq.detokenizer.flush()
            seq.finish(FinishReason.LENGTH, text, token_ids=ids, logprobs=logprobs)
        else:
            seq.emit(text, ids, logprobs)

    def _compact(self) -> None:
        for seq in self.batch.remove_finished():
            self._free(seq)

    def _free(self, seq: Sequence) -> None:
        self.allocator.free(seq.blocks)
        seq.blocks = []

    def _fail_all(self, message: str) -> None:
        for seq in self.batch.rows:
            seq.finish(FinishReason.ERROR, error=message)
        self._compact()
