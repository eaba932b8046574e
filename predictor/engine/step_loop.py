"""The step loop: one thread that runs the batch one token at a time.

Each step: retire aborted and timed-out rows, admit waiting requests (each reserves the KV
blocks it may need), then run one forward pass that feeds every decoding row its last token and
the prefilling rows the next chunks of their prompts, within a per-step token budget (chunked
prefill: a long prompt never stalls the running streams for more than a chunk), sample the rows
that got logits and send each row its event. This is the only loop over the batch, and the only
code that calls the runner.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from predictor.engine.batch import Batch, Sequence
from predictor.engine.kv_cache import BlockAllocator, blocks_for
from predictor.engine.sampling import make_generator, sample
from predictor.engine.scheduler import Scheduler
from predictor.engine.step import Runner, StepRow
from predictor.types import FinishReason, TokenLogprob, TopLogprob

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
        # called on this thread after each step: AsyncEngine hands the step's events to asyncio
        # in one batch there (one wake-up of the event loop per step, not one per row)
        self.after_step: Callable[[], None] | None = None
        # when the last step (or idle wait) ended, for liveness: rows running and no step done
        # for a long time means a hung kernel
        self.last_progress = clock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
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
        for seq in self.scheduler.drop_expired(now):  # never prefilled
            seq.finish(FinishReason.TIMEOUT)
        for seq in self.batch.rows:
            if seq.aborted:
                seq.finish(FinishReason.CANCELLED, seq.detokenizer.flush())
            elif seq.deadline is not None and now >= seq.deadline:
                seq.finish(FinishReason.TIMEOUT, seq.detokenizer.flush())
        self._compact()

    def _admit(self) -> None:
        admitted = self.scheduler.admit(len(self.batch), self.allocator)
        if not admitted:
            return
        now = self._clock()
        joined = []
        for seq in admitted:
            try:
                seq.generator = make_generator(seq.params.seed, self.runner.device)
                if self._on_admit is not None:
                    self._on_admit(now - seq.arrival)
            except Exception:  # fails this request only; its reservation goes back
                log.exception("admitting request %s failed", seq.request_id)
                seq.finish(FinishReason.ERROR, error="the request could not be admitted")
                self._free(seq)
                continue
            joined.append(seq)
        self.batch.extend(joined)

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
            chunk = seq.prompt_ids[seq.cached : seq.cached + max(budget, 1)]
            budget -= len(chunk)
            done = seq.cached + len(chunk) == len(seq.prompt_ids)
            fed.append(seq)
            rows.append(StepRow(seq.blocks, seq.cached, chunk, logits=done))
        for seq, row in zip(fed, rows, strict=True):
            need = blocks_for(row.start + len(row.tokens), self.allocator.block_size)
            if need > len(seq.blocks):  # next to the row's blocks, or where its reservation fits
                after = seq.blocks[-1] if seq.blocks else None
                more = self.allocator.allocate(need - len(seq.blocks), after, seq.reserved_blocks)
                seq.blocks.extend(more)
        return fed, rows

    def _forward(self) -> None:
        fed, rows = self._plan()
        try:
            logits = self.runner.forward(rows)
        except Exception:  # the detail goes to the log, a short message to the clients
            log.exception("forward pass failed")
            for seq in fed:  # their cache contents are unknown now; rows not fed are intact
                seq.finish(FinishReason.ERROR, error="forward pass failed")
            self._compact()
            return
        sampled = []
        for seq, row in zip(fed, rows, strict=True):
            seq.cached += len(row.tokens)
            if row.logits:
                sampled.append(seq)
        self._accept(sampled, logits)
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
            if token < 0:
                seq.finish(FinishReason.ERROR, error="the model produced non-finite logits")
                continue
            logprobs: tuple[TokenLogprob, ...] = ()
            if logprob is not None:
                logprobs = (self._token_logprob(seq, token, *logprob),)
            self._advance(seq, token, logprobs)

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
        self.allocator.release(seq.reserved_blocks)
        seq.blocks, seq.reserved_blocks = [], 0

    def _fail_all(self, message: str) -> None:
        for seq in self.batch.rows:
            seq.finish(FinishReason.ERROR, error=message)
        self._compact()
