"""The step loop: one thread that runs the batch, a step at a time.

Each step (vLLM v1's `EngineCore.step`): retire aborted and timed-out rows, let the scheduler
decide the step (`Scheduler.schedule`: admission, growth, preemption, each row's tokens), start
the requests it admitted, run one forward pass, book it (`Scheduler.update`), sample the rows
that got logits and send each row its event (outputs.py: what a token does to its request).
This is the only loop over the batch, and the only code that calls the runner. After each step
the loop publishes its `LoopStatus` (what other threads read of it: `status`), then a listener
(the asyncio front) gets its `StepStats`.

A preempted row, readmitted, samples on from where it stopped with the same generator, so its
stream neither repeats nor loses a token.

Sleep (engine/sleep.py): idle for `Sleep.idle_seconds`, or asked (`sleep`), the loop drops its
runner and the prefix cache between two steps; the next step with work, or `wake_up`, builds
the runner again first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from predictor.engine.chores import Chore, Chores
from predictor.engine.outputs import Outputs, Verified
from predictor.engine.request import Request
from predictor.engine.sampling import make_generator, select_rows
from predictor.engine.scheduler import Schedule, Scheduler
from predictor.engine.sleep import ASKED, IDLE, Sleep
from predictor.engine.step import LoopStatus, Runner, StepStats
from predictor.types import FinishReason, run_to_end

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
        vocab: int | None = None,
        sleep: Sleep | None = None,
    ) -> None:
        """`vocab`: the tokenizer's token count. A head may have more rows (Qwen3: 151,936 for
        151,669 tokens): those past it spell no text and are never sampled."""
        # None while asleep (`sleep`): read and replaced on the loop's thread only
        self.runner: Runner | None = runner
        self._device = runner.device
        self._sleep = sleep  # how it sleeps and wakes (None: it never sleeps)
        self.scheduler = scheduler
        self._eos_ids = frozenset(eos_ids)
        self._outputs = Outputs(self._eos_ids)  # what a sampled token does to its request
        self._vocab = vocab
        self._clock = clock
        self._on_prepared = on_prepared  # called once, on this thread, when ready
        self._listener: StepListener | None = None  # given by `start`
        # when the last step (or idle wait) ended, for liveness: rows running and no step done
        # for a long time means a hung kernel
        self._progress = clock()
        self._handed = 0  # requests handed to the queue (add_all, the asyncio side's count)
        # what other threads read (status): replaced whole by the loop's thread, never changed
        self._status = LoopStatus(progress=self._progress)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        # set once the runner is bound to this thread (its kernels compiled and tuned): until
        # then the engine is not ready, so a first request is not sent to wait out the autotune
        self.prepared = threading.Event()
        self._thread: threading.Thread | None = None
        self._chores = Chores()  # work between steps (run_chore)
        self._busy_at = clock()  # when a step last ran: the idle time sleep counts from

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

    @property
    def can_sleep(self) -> bool:
        return self._sleep is not None

    def sleeping(self) -> bool:
        """Whether the runner is freed now (any thread: one read)."""
        return self.runner is None

    def notify(self) -> None:
        self._wake.set()

    # -- what other threads see (any thread) ------------------------------------------------
    def status(self) -> LoopStatus:
        """The state the loop's thread last published (one read of one immutable value)."""
        return self._status

    def add_all(self, requests: list[Request]) -> None:
        """Queue every one of `requests` or none (Overloaded), and wake the loop."""
        queue = self.scheduler.queue
        with queue.lock:  # the count and the queue move together (_publish reads both)
            self.scheduler.add_all(requests)
            self._handed += len(requests)
        self._wake.set()

    def waiting(self) -> int:
        """Requests in the queue: the published count and those handed to it since."""
        status = self._status
        return status.waiting + self._handed - status.handed

    @property
    def kv_blocks(self) -> tuple[int, int]:
        """The KV cache's (blocks, tokens a block): fixed at start."""
        cache = self.scheduler.allocator
        return cache.num_blocks, cache.block_size

    def adapters_in_use(self) -> set[int]:
        """The LoRA slots of the running rows and of the waiting requests now (the loop's
        thread only: between two steps, as the step listener runs)."""
        scheduler = self.scheduler
        with scheduler.queue.lock:
            waiting = {r.adapter for r in scheduler.queue}
        return waiting | {r.adapter for r in scheduler.running}

    def _publish(self) -> None:
        """The loop's state for other threads, read on the loop's thread (`status`)."""
        scheduler = self.scheduler
        with scheduler.queue.lock:
            waiting = tuple(r.adapter for r in scheduler.queue)
            handed = self._handed
        running = tuple(r.adapter for r in scheduler.running)
        self._status = LoopStatus(
            running=len(running),
            waiting=len(waiting),
            handed=handed,
            kv_usage=scheduler.allocator.usage(),
            running_adapters=running,
            waiting_adapters=waiting,
            progress=self._progress,
        )

    def run_chore(self, chore: Chore) -> Any:
        """`chore`'s result, its slices run on the loop's thread, one between two steps (while
        no step runs, one after another: chores.py says why); blocks the calling thread (not
        the loop's) until it is done, and raises what it raised. Where the loop does not run
        yet, here at once."""
        if not self.alive():
            return run_to_end(chore)
        if self._stopping.is_set():
            raise RuntimeError("engine stopped")
        future = self._chores.submit(chore)
        self._wake.set()
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:  # a loop that stopped after the check above tells no one
                if not self.alive():
                    raise RuntimeError("engine stopped") from None

    # -- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        assert self.runner is not None
        self.runner.bind_thread()
        self._progress = self._busy_at = self._clock()
        self._publish()
        self.prepared.set()
        if self._on_prepared is not None:
            self._on_prepared()
        while not self._stopping.is_set():
            if self._chores:
                self._chores.run_slice()
            if not self.scheduler.running and not self.scheduler.waiting():
                if self._idle_too_long():
                    self._fall_asleep(IDLE)
                if not self._chores:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                self._progress = self._clock()
                self._publish()
                continue
            if self.runner is None and not self._reload():
                continue
            try:
                stats = self.step()
            except Exception:  # a bug here must not kill the engine
                log.exception("engine step failed")
                self._fail_all("engine step failed")
                stats = self._stats(Schedule())
            self._progress = self._busy_at = self._clock()
            self._tell(stats)
        self._fail_all("engine stopped")
        self._chores.fail_all("engine stopped")  # their callers wait: they are told
        for request in self.scheduler.drain():
            request.finish(FinishReason.ERROR, error="engine stopped")
        self._tell(self._stats(Schedule()))

    def _tell(self, stats: StepStats) -> None:
        """Publish the loop's status, then hand the listener the stats (its events go out
        after the status shows where the step left the rows)."""
        self._publish()
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
        self._publish()  # the rows this step runs, seen while it runs
        started = time.perf_counter()
        sampled, verified = self._forward(schedule) if schedule.rows else (0, Verified())
        self.scheduler.timed(schedule, time.perf_counter() - started)
        self.scheduler.remove_finished()
        if self.scheduler.events is not None:  # the step's KV events, one batch
            self.scheduler.events.flush()
        return self._stats(schedule, sampled, verified)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, between two steps (blocks the calling thread): False
        while a row holds blocks (vLLM's answer), else True (an AllBlocksCleared event)."""

        def reset() -> Chore:
            done = self.scheduler.reset_prefix_cache()
            if self.scheduler.events is not None:
                self.scheduler.events.flush()
            return done
            yield  # a chore: a generator of one slice

        return bool(self.run_chore(reset()))

    def sleep(self) -> bool:
        """Fall asleep between two steps (blocks the calling thread): the running rows go back
        to the queue, so a request waiting or arriving wakes the engine again at once. False
        where it cannot sleep (no `Sleep`); True once asleep, or where it was already."""
        if self._sleep is None:
            return False

        def fall_asleep() -> Chore:
            if self.runner is not None:
                self._fall_asleep(ASKED)
            return True
            yield  # a chore: a generator of one slice

        return bool(self.run_chore(fall_asleep()))

    def wake_up(self) -> bool:
        """Build the runner again now, between two steps, if it sleeps (blocks the calling
        thread); False where the model could not be loaded (the log says why)."""

        def wake() -> Chore:
            return self.runner is not None or self._reload()
            yield  # a chore: a generator of one slice

        return bool(self.run_chore(wake()))

    def _idle_too_long(self) -> bool:
        """Awake, with nothing to do for --sleep-idle-seconds."""
        idle_for = self._clock() - self._busy_at
        return self._sleep is not None and self.runner is not None and self._sleep.due(idle_for)

    def _fall_asleep(self, reason: str) -> None:
        """Drop the runner and everything the KV cache held (`Sleep.fall_asleep`)."""
        assert self._sleep is not None
        suspended = self._sleep.fall_asleep(self.scheduler, self._take_runner, self._clock, reason)
        self._tell(self._stats(Schedule(preempted=suspended), slept=reason))

    def _take_runner(self) -> Runner:
        """The runner, no longer the loop's: the caller holds its last reference."""
        runner, self.runner = self.runner, None
        assert runner is not None
        return runner

    def _reload(self) -> bool:
        """Build and bind the runner again (`Sleep.wake`); False where that failed."""
        assert self._sleep is not None
        started = time.perf_counter()
        self.runner = self._sleep.wake(self.scheduler)
        self._busy_at = self._clock()  # idle from now: a wake with nothing to do sleeps later
        woke = time.perf_counter() - started if self.runner is not None else 0.0
        self._tell(self._stats(Schedule(), woke=woke))
        return self.runner is not None

    def _stats(
        self,
        schedule: Schedule,
        sampled: int = 0,
        verified: Verified | None = None,
        slept: str = "",
        woke: float = 0.0,
    ) -> StepStats:
        verified = verified or Verified()
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
            draft_rows=verified.rows,
            draft_tokens=verified.drafts,
            accepted_tokens=sum(verified.accepted),
            accepted_per_position=verified.per_position,
            slept=slept,
            woke=woke,
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
                request.generator = make_generator(request.params.seed, self._device)
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

    def _forward(self, schedule: Schedule) -> tuple[int, Verified]:
        """Run the step's rows; score, sample and advance them, verify drafts, book the cache.
        Returns the rows sampled and what the drafts came to."""
        assert self.runner is not None  # woken before any step (_run)
        try:
            logits = self.runner.forward(schedule.rows)
        except Exception:  # the detail goes to the log, a short message to the clients
            log.exception("forward pass failed")
            for request in schedule.requests:  # their cache contents are unknown now
                request.finish(FinishReason.ERROR, error="forward pass failed")
            return 0, Verified()  # the rows not fed are intact
        if self._vocab is not None and logits.shape[-1] > self._vocab:
            logits[:, self._vocab :] = float("-inf")  # the head's padding rows
        sampled = []
        at: list[int] = []  # the rows of `logits` sampled from
        verifying: list[tuple[Request, int, list[int]]] = []  # (row, its first logits, drafts)
        first = 0  # the row of `logits` where this row's begin
        drafted = range(schedule.decode_rows, schedule.decode_rows + schedule.verify_rows)
        for i, (request, row) in enumerate(schedule):
            if i in drafted:
                assert request.speculation is not None
                verifying.append((request, first, request.speculation.drafts))
                request.draft_tokens += len(request.speculation.drafts)
                sampled.append(request)
                at.append(first)  # the token after its last one; the drafts' own: below
            else:
                if row.all_logits:
                    self._outputs.score(request, row, logits[first : first + len(row.tokens)])
                if row.logits:
                    sampled.append(request)
                    at.append(first + row.logit_count - 1)
            first += row.logit_count
        if sampled:
            checked = None  # each row's first draft, where it has drafts
            if verifying:
                drafts = {id(request): d[0] for request, _, d in verifying}
                checked = [drafts.get(id(r)) for r in sampled]
            self._outputs.accept(sampled, select_rows(logits, at), checked)
        verified = self._outputs.verify(verifying, logits)
        computed = [len(row.tokens) for row in schedule.rows]
        for i, accepted in zip(drafted, verified.accepted, strict=True):
            computed[i] = 1 + accepted  # the last token's keys and the accepted drafts'
        self.scheduler.update(schedule, computed)
        for request, row in schedule:
            if not row.logits and request.echo_only and request.cached >= len(request.prompt_ids):
                request.finish(FinishReason.LENGTH)  # echo only: the prompt is scored
        return len(sampled), verified

    def _fail_all(self, message: str) -> None:
        for request in self.scheduler.running:
            request.finish(FinishReason.ERROR, error=message)
        self.scheduler.remove_finished()
