"""The step loop: one thread that runs the batch, a step at a time.

Each step (vLLM v1's `EngineCore.step`): retire aborted and timed-out rows, let the scheduler
decide the step (`Scheduler.schedule`: admission, growth, preemption, each row's tokens), start
the requests it admitted, run one forward pass, book it (`Scheduler.update`), sample the rows
that got logits and send each row its event. This is the only loop over the batch, and the only
code that calls the runner. After each step a listener (the asyncio front) gets its `StepStats`.

A preempted row, readmitted, samples on from where it stopped with the same generator, so its
stream neither repeats nor loses a token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from predictor.engine.request import Request
from predictor.engine.sampling import (
    NO_TOKEN_ALLOWED,
    make_generator,
    sample,
    score_tokens,
    select_rows,
)
from predictor.engine.scheduler import Schedule, Scheduler
from predictor.engine.step import Runner, StepRow, StepStats
from predictor.types import FinishReason, PromptToken, TokenLogprob, TopLogprob

if TYPE_CHECKING:  # annotations only: the runners run torch
    import torch

log = logging.getLogger(__name__)

StepListener = Callable[[StepStats], None]


class StepLoop:
    def __init__(
        self,
        runner: Runner,
        scheduler: Scheduler,
        eos_ids: Collection[int],
        clock: Callable[[], float] = time.monotonic,
        on_prepared: Callable[[], None] | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self._eos_ids = frozenset(eos_ids)
        self._clock = clock
        self._on_prepared = on_prepared  # called once, on this thread, when ready
        self._listener: StepListener | None = None  # given by `start`
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
    def start(self, listener: StepListener | None = None) -> None:
        """Run on a thread of its own; `listener` gets each step's stats on that thread."""
        if self._thread is not None:
            return
        self._listener = listener
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
            if not self.scheduler.running and not self.scheduler.waiting():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                self.last_progress = self._clock()
                continue
            try:
                stats = self.step()
            except Exception:  # a bug here must not kill the engine
                log.exception("engine step failed")
                self._fail_all("engine step failed")
                stats = self._stats(Schedule())
            self.last_progress = self._clock()
            self._tell(stats)
        self._fail_all("engine stopped")
        for request in self.scheduler.drain():
            request.finish(FinishReason.ERROR, error="engine stopped")
        self._tell(self._stats(Schedule()))

    def _tell(self, stats: StepStats) -> None:
        if self._listener is None:
            return
        try:
            self._listener(stats)
        except Exception:  # a metrics backend or a closed client must not stop the engine
            log.exception("the step listener failed")

    def step(self) -> StepStats:
        """retire -> schedule -> start the admitted -> forward -> update."""
        self._retire()
        schedule = self.scheduler.schedule()
        self._start(schedule)
        sampled = self._forward(schedule) if schedule.rows else 0
        self.scheduler.remove_finished()
        return self._stats(schedule, sampled)

    def _stats(self, schedule: Schedule, sampled: int = 0) -> StepStats:
        first = [r for r in schedule.admitted + schedule.echoed if r.scheduled is not None]
        prefix: tuple[tuple[int, int], ...] = ()
        if self.scheduler.prefix_caching:
            prefix = tuple((len(r.prompt_ids), r.cached_prompt_tokens) for r in first)
        return StepStats(
            running=len(self.scheduler.running),
            waiting=self.scheduler.waiting(),
            sampled=sampled,
            fed=schedule.tokens,
            queue_waits=tuple(r.scheduled - r.arrival for r in first if r.scheduled is not None),
            prefix_queries=prefix,
            preemptions=len(schedule.preempted),
        )

    def _retire(self) -> None:
        for request in self.scheduler.drop_aborted():
            request.finish(FinishReason.CANCELLED)
        now = self._clock()
        for request in self.scheduler.drop_expired(now):  # not running (never, or preempted)
            flushed = request.detokenizer.flush() if request.output_ids else ""
            request.finish(FinishReason.TIMEOUT, flushed)
        for request in self.scheduler.running:
            if request.aborted:
                request.finish(FinishReason.CANCELLED, request.detokenizer.flush())
            elif request.deadline is not None and now >= request.deadline:
                request.finish(FinishReason.TIMEOUT, request.detokenizer.flush())
        self.scheduler.remove_finished()

    def _start(self, schedule: Schedule) -> None:
        """The requests admitted for the first time get their sampling generator and their
        start time; a failure fails that request only (its blocks go back), and a request with
        nothing to run (echo only) ends here."""
        now = self._clock()
        for request in schedule.preempted:
            request.preempted_at.append(now)
        for request in schedule.admitted:
            try:
                request.generator = make_generator(request.params.seed, self.runner.device)
            except Exception:
                log.exception("admitting request %s failed", request.request_id)
                request.finish(FinishReason.ERROR, error="the request could not be admitted")
                schedule.drop(request)
                continue
            request.scheduled = now
        for request in schedule.echoed:
            request.scheduled = now
            request.finish(FinishReason.LENGTH)
        self.scheduler.remove_finished()

    def _forward(self, schedule: Schedule) -> int:
        """Run the step's rows; score, sample and advance them. Returns the rows sampled."""
        try:
            logits = self.runner.forward(schedule.rows)
        except Exception:  # the detail goes to the log, a short message to the clients
            log.exception("forward pass failed")
            for request in schedule.requests:  # their cache contents are unknown now
                request.finish(FinishReason.ERROR, error="forward pass failed")
            return 0  # the rows not fed are intact
        self.scheduler.update(schedule)
        sampled = []
        at: list[int] = []  # the rows of `logits` sampled from
        first = 0  # the row of `logits` where this row's begin
        for request, row in schedule:
            if row.all_logits:
                self._score(request, row, logits[first : first + len(row.tokens)])
            first += row.logit_count
            if row.logits:
                sampled.append(request)
                at.append(first - 1)
            elif request.echo_only and request.cached >= len(request.prompt_ids):
                request.finish(FinishReason.LENGTH)  # echo only: the prompt is scored
        if sampled:
            self._accept(sampled, select_rows(logits, at))
        return len(sampled)

    def _accept(self, requests: list[Request], logits: torch.Tensor) -> None:
        # logits: [len(requests), V]
        try:
            result = sample(logits, requests, self._eos_ids)
        except Exception:  # a sampling bug must fail these rows, not the engine
            log.exception("sampling failed")
            for request in requests:
                request.finish(FinishReason.ERROR, error="sampling failed")
            return
        for request, token, logprob in zip(requests, result.tokens, result.logprobs, strict=True):
            if token == NO_TOKEN_ALLOWED and request.params.grammar is not None:
                param = request.params.grammar.param  # the request's constraint, not the model
                request.finish(FinishReason.ERROR, request.detokenizer.flush(), error_param=param,
                           error=f"no text satisfies '{param}' past what was generated: it "
                           "allows no next token")  # fmt: skip
                continue
            if token < 0:
                request.finish(FinishReason.ERROR, error="the model produced non-finite logits")
                continue
            logprobs: tuple[TokenLogprob, ...] = ()
            if logprob is not None:
                logprobs = (self._token_logprob(request, token, *logprob),)
            self._advance(request, token, logprobs)

    @staticmethod
    def _score(request: Request, row: StepRow, logits: torch.Tensor) -> None:
        """Score the prompt tokens that follow this chunk's positions (logits [len(tokens),
        V]: position start + i's), skipping those scored before a preemption."""
        scores = request.prompt_scores
        skip = len(scores) - 1 - row.start  # positions already scored
        targets = request.prompt_ids[len(scores) : row.start + len(row.tokens) + 1]
        if skip < 0 or not targets:
            return
        k = request.params.prompt_logprobs or 0
        text = request.detokenizer.token_text
        scored = score_tokens(logits[skip : skip + len(targets)], targets, k)
        for token, (logprob, rank, top) in zip(targets, scored, strict=True):
            tops = tuple(TopLogprob(t, text(t), lp) for t, lp in top)
            scores.append(PromptToken(token, text(token), logprob, rank, tops))

    @staticmethod
    def _token_logprob(
        request: Request, token: int, logprob: float, top: list[tuple[int, float]]
    ) -> TokenLogprob:
        text = request.detokenizer.token_text
        return TokenLogprob(
            token, text(token), logprob, tuple(TopLogprob(t, text(t), lp) for t, lp in top)
        )

    def _advance(self, request: Request, token: int, logprobs: tuple[TokenLogprob, ...]) -> None:
        request.output_ids.append(token)
        ids = (token,)
        generated = len(request.output_ids)
        # min_tokens (vLLM's meaning): eos may end the request only after that many tokens,
        # stop strings are looked for once that many exist
        eos_armed = generated > request.params.min_tokens and not request.params.ignore_eos
        matcher = request.matcher
        if matcher is not None:  # the grammar says when the text ends: eos is its end
            if not matcher.accept(token):
                request.finish(FinishReason.ERROR, error="the grammar refused the sampled token")
                return
            eos_armed = True
        if token in self._eos_ids and eos_armed:
            request.finish(
                FinishReason.EOS, request.detokenizer.flush(), token_ids=ids, logprobs=logprobs
            )
            return
        text = request.detokenizer.push(token, check_stop=generated >= request.params.min_tokens)
        if matcher is not None and not request.detokenizer.stopped and matcher.finished:
            text += request.detokenizer.flush()
            request.finish(FinishReason.EOS, text, token_ids=ids, logprobs=logprobs)
        elif request.detokenizer.stopped:
            request.finish(FinishReason.STOP, text, token_ids=ids, logprobs=logprobs)
        elif generated >= request.params.max_tokens:
            text += request.detokenizer.flush()
            request.finish(FinishReason.LENGTH, text, token_ids=ids, logprobs=logprobs)
        else:
            request.emit(text, ids, logprobs)

    def _fail_all(self, message: str) -> None:
        for request in self.scheduler.running:
            request.finish(FinishReason.ERROR, error=message)
        self.scheduler.remove_finished()
