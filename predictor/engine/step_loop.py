"""The step loop: one thread that runs the batch one token at a time.

Each step: retire aborted and timed-out rows, admit waiting requests (prefill them together,
merge them into the cache), then decode one token for every row and send each row its event.
This is the only loop over the batch, and the only code that calls the runner.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Protocol

import torch

from predictor.engine.batch import Batch, Sequence
from predictor.engine.sampling import draw, finite_rows, greedy, make_generator
from predictor.engine.scheduler import Scheduler
from predictor.types import FinishReason

log = logging.getLogger(__name__)


class Runner(Protocol):
    device: torch.device

    def bind_thread(self) -> None: ...
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor: ...
    def decode(self, last_tokens: list[int]) -> torch.Tensor: ...
    def keep(self, rows: list[int]) -> None: ...
    def reset(self) -> None: ...


class StepLoop:
    def __init__(
        self,
        runner: Runner,
        scheduler: Scheduler,
        eos_ids: Collection[int],
        clock: Callable[[], float] = time.monotonic,
        on_step: Callable[[int], None] | None = None,
        on_admit: Callable[[float], None] | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.batch = Batch()
        self._eos_ids = frozenset(eos_ids)
        self._clock = clock
        self._on_step = on_step  # called with the batch size after each decode step
        self._on_admit = on_admit  # called with each admitted request's waiting time
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
                continue
            try:
                self.step()
            except Exception as exc:  # a bug here must not kill the engine
                log.exception("engine step failed")
                self._fail_all(f"engine step failed: {exc}")
        self._fail_all("engine stopped")
        for seq in self.scheduler.drain():
            seq.finish(FinishReason.ERROR, error="engine stopped")

    def step(self) -> None:
        self._retire()
        admitted = self.scheduler.admit(len(self.batch), self.batch.budget_tokens)
        if admitted:
            self._prefill(admitted)
        if self.batch:
            self._decode()

    def _retire(self) -> None:
        for seq in self.scheduler.drop_aborted():
            seq.finish(FinishReason.CANCELLED)
        now = self._clock()
        for seq in self.batch.rows:
            if seq.aborted:
                seq.finish(FinishReason.CANCELLED, seq.detokenizer.flush())
            elif seq.deadline is not None and now >= seq.deadline:
                seq.finish(FinishReason.TIMEOUT, seq.detokenizer.flush())
        self._compact()

    def _prefill(self, seqs: list[Sequence]) -> None:
        try:
            logits = self.runner.prefill([seq.prompt_ids for seq in seqs])
        except Exception as exc:
            log.exception("prefill failed")
            for seq in seqs:  # the cache is untouched: only the newcomers fail
                seq.finish(FinishReason.ERROR, error=f"prefill failed: {exc}")
            return
        now = self._clock()
        for seq in seqs:
            seq.generator = make_generator(seq.params.seed, self.runner.device)
            if self._on_admit is not None:
                self._on_admit(now - seq.arrival)
        self.batch.extend(seqs)
        self._accept(seqs, logits)
        self._compact()

    def _decode(self) -> None:
        rows = self.batch.rows
        try:
            logits = self.runner.decode([seq.output_ids[-1] for seq in rows])
        except Exception as exc:
            log.exception("decode failed")
            self._fail_all(f"forward pass failed: {exc}")
            return
        self._accept(rows, logits)
        if self._on_step is not None:
            self._on_step(len(rows))
        self._compact()

    def _accept(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        # logits: [len(seqs), V]
        finite = finite_rows(logits)
        good = [i for i, ok in enumerate(finite) if ok]
        for i, ok in enumerate(finite):
            if not ok:
                seqs[i].finish(FinishReason.ERROR, error="the model produced non-finite logits")
        if not good:
            return
        rows = logits if len(good) == len(seqs) else logits[good]
        chosen = [seqs[i] for i in good]
        greedy_ids = greedy(rows)
        for row, seq in enumerate(chosen):
            if seq.params.greedy:
                token = greedy_ids[row]
            else:
                try:
                    token = draw(rows[row], seq.params, seq.generator)
                except Exception as exc:  # one request's sampling must not fail the batch
                    seq.finish(FinishReason.ERROR, error=f"sampling failed: {exc}")
                    continue
            self._advance(seq, token)

    def _advance(self, seq: Sequence, token: int) -> None:
        seq.output_ids.append(token)
        ids = (token,)
        if token in self._eos_ids:
            seq.finish(FinishReason.EOS, seq.detokenizer.flush(), token_ids=ids)
            return
        text = seq.detokenizer.push(token)
        if seq.detokenizer.stopped:
            seq.finish(FinishReason.STOP, text, token_ids=ids)
        elif len(seq.output_ids) >= seq.params.max_tokens:
            seq.finish(FinishReason.LENGTH, text + seq.detokenizer.flush(), token_ids=ids)
        else:
            seq.emit(text, ids)

    def _compact(self) -> None:
        kept = self.batch.remove_finished()
        if kept is not None:
            self.runner.keep(kept)

    def _fail_all(self, message: str) -> None:
        for seq in self.batch.rows:
            seq.finish(FinishReason.ERROR, error=message)
        self.batch.rows = []
        self.runner.reset()
