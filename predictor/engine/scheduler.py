"""Who runs next, and how much of each: the scheduler owns every decision of a step.

`schedule()` (vLLM v1's `Scheduler.schedule`) makes one `Schedule`: it admits waiting requests
within the row limit and the KV-cache blocks (each takes its cached prefix and blocks for the rest
of its prompt), gives each decoding row the block its next token needs (preempting when the cache
is dry), and spends the step's token budget: every decoding row one token first, then prompt
chunks (chunked prefill: a long prompt never stalls the running streams for more than a chunk).
`update()` books what a forward pass computed: the rows' cache positions, and the blocks that
filled up offered to the prefix cache.

Order (vLLM's priority scheduling): a request's `priority` (lower runs sooner, default 0), then
its arrival. The queue is kept in that order; the row preempted when the cache is dry is the
last in that order, and a waiting request that does not fit preempts running rows that come
after it. With every priority 0 this is first come, first served, preempting the newest.

Preemption by recompute (vLLM's): a preempted row gives back its blocks and goes back to the
queue in its place (ahead of every later arrival of its priority) with its output so far;
readmitted, it prefills prompt + output (mostly from its own blocks, still cached unless evicted)
and samples on from where it stopped.

Thread-safety: adapters add requests from the event loop thread (`add`, `add_all`) and read
`waiting` and `rows`; everything else runs on the step loop's thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from predictor.engine.drafting import Speculation
from predictor.engine.kv_cache import BlockAllocator, BlockKey, blocks_for
from predictor.engine.kv_events import Recorder
from predictor.engine.kv_offload import Offload
from predictor.engine.request import Request
from predictor.engine.step import StepRow
from predictor.engine.waiting import WaitingQueue, order


@dataclass
class Schedule:
    """One step's decisions: which requests are fed what, in row order (decode rows first)."""

    requests: list[Request] = field(default_factory=list)
    rows: list[StepRow] = field(default_factory=list)
    decode_rows: int = 0  # rows[:decode_rows] feed one token each, to a row with a cache
    verify_rows: int = 0  # rows[decode_rows:decode_rows + verify_rows] carry draft tokens
    admitted: list[Request] = field(default_factory=list)  # first admissions (not resumed)
    resumed: list[Request] = field(default_factory=list)  # readmitted after a preemption
    # admitted with nothing to run (echo only, no prompt to score): their blocks already freed,
    # the step loop finishes them
    echoed: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def __iter__(self) -> Iterator[tuple[Request, StepRow]]:
        return zip(self.requests, self.rows, strict=True)

    @property
    def tokens(self) -> int:
        return sum(len(row.tokens) for row in self.rows)

    def check(self) -> None:
        """The order the runner relies on (runners/plan.py attends the leading one-token rows
        as decode rows, one query each, and any row after a prompt chunk as a prefill):
        the first `decode_rows` rows feed one token to a row with a cache, and return its
        logits."""
        for row in self.rows[: self.decode_rows]:
            assert len(row.tokens) == 1 and row.start > 0 and row.logits and not row.all_logits

    def drop(self, request: Request) -> None:
        """Take a request out of this step (it failed before the forward pass)."""
        for i, scheduled in enumerate(self.requests):
            if scheduled is request:
                del self.requests[i], self.rows[i]
                if i < self.decode_rows:
                    self.decode_rows -= 1
                elif i < self.decode_rows + self.verify_rows:
                    self.verify_rows -= 1
                return


class Scheduler:
    """In the queue's order (priority, then arrival), within `max_batch_size` rows, the KV
    cache and a per-step budget of `max_step_tokens` fed tokens."""

    def __init__(
        self,
        max_batch_size: int,
        max_waiting: int,
        allocator: BlockAllocator | None = None,
        max_step_tokens: int = 256,
        prefix_caching: bool = True,
        speculation: Speculation | None = None,
        max_loras: int = 0,
        events: Recorder | None = None,
        offload: Offload | None = None,
    ) -> None:
        self.max_batch_size = max_batch_size
        # the cache this scheduler spends (a hand-built one for the scheduler's own tests)
        self.allocator = allocator if allocator is not None else BlockAllocator(256, 16)
        self.max_step_tokens = max_step_tokens
        self.prefix_caching = prefix_caching
        # speculative decoding: who drafts, and whether a step's drafts pay (None: off)
        self.speculation = speculation
        self.running: list[Request] = []  # admitted, holding blocks, in admission order
        self.queue = WaitingQueue(max_waiting)  # the rest, in `order`
        self.max_loras = max_loras  # distinct LoRA adapters in one step (0: any number)
        self.events = events  # KV events of the prefix cache (None: off)
        self.offload = offload  # the prefix cache's blocks on disk (None: off)

    # -- the queue (any thread) -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.queue.add([request])

    def add_all(self, requests: list[Request]) -> None:
        """Queue every one of `requests` or none (Overloaded)."""
        self.queue.add(requests)

    def waiting(self) -> int:
        return len(self.queue)

    def rows(self) -> int:
        """Requests holding a row now (any thread: one read of a list's length)."""
        return len(self.running)

    def drop_aborted(self) -> list[Request]:
        """Remove and return waiting requests that were aborted before they got a row."""
        return self.queue.drop(lambda r: r.aborted)

    def drop_expired(self, now: float) -> list[Request]:
        """Remove and return waiting requests whose deadline passed before they got a row."""
        return self.queue.drop(lambda r: r.deadline is not None and now >= r.deadline)

    def drain(self) -> list[Request]:
        """Remove and return every waiting request."""
        return self.queue.drop(lambda r: True)

    # -- the step (the step loop's thread) ---------------------------------------------------
    def schedule(self) -> Schedule:
        """Admission, growth and preemption, then each running row's tokens for this step."""
        schedule = Schedule()
        for request in self.admit(schedule):
            if request.echo_only and not request.scoring and not request.preemptions:
                schedule.echoed.append(request)
                self.free(request)
                continue
            # a resumed row's generator, queue time and cache query stand
            (schedule.resumed if request.preemptions else schedule.admitted).append(request)
            self.running.append(request)
            drafts = request.params.speculative and not request.echo_only
            if self.speculation is not None and request.speculation is None and drafts:
                request.speculation = self.speculation.proposer.state()
        self._grow(schedule)
        self._plan(schedule)
        if self.offload is not None:  # blocks evicted this step: out before the forward pass
            self.offload.flush()
        schedule.check()
        return schedule

    def admit(self, schedule: Schedule | None = None) -> list[Request]:
        """Take waiting requests, in order, while rows and KV-cache blocks allow (they are
        not running yet: `schedule` adds them); where the next does not fit, running rows that
        come after it in order (a lower priority) are preempted to make room (into `schedule`).

        A request takes the blocks of its longest cached prefix (never its last token: that
        one's logits are needed) and new blocks for the rest of its prompt, when that leaves a
        small headroom for the running rows to grow into (none needed by a lone request). A
        request whose prompt must be scored (prompt_logprobs) takes no cached prefix, as vLLM
        does: every position it scores is computed. Its output later grows one block at a
        time; `schedule` preempts when none is left. With the disk cache, the blocks that
        follow the cached prefix and are on disk are read into the request's new blocks
        instead of being computed (`_load`).
        """
        admitted: list[Request] = []
        cache = self.allocator
        size = cache.block_size
        headroom = max(1, cache.num_blocks // 100)  # vLLM's watermark: 1% of the blocks
        with self.queue.lock:
            while (request := self.queue.head()) is not None:
                running = len(self.running) + len(admitted)
                total = request.total_tokens
                hit: list[int] = []
                keys: list[BlockKey] = []
                if self.prefix_caching and not request.scoring:  # scored positions are computed
                    keys = request.block_keys((total - 1) // size, size)
                    hit = cache.match(keys)
                new = blocks_for(total, size) - len(hit)
                spare = headroom if running else 0
                if self._another_adapter(request, admitted):
                    break  # it waits for a row of one of the step's adapters to end
                if running >= self.max_batch_size or (
                    cache.available - cache.unheld(hit) < new + spare
                ):
                    last = max(self.running, key=order, default=None)
                    if schedule is None or last is None or order(last)[0] <= order(request)[0]:
                        break
                    self._preempt(last, schedule)
                    continue
                cache.share(hit)
                # room to grow adjacent: the output's blocks, up to 16 of them
                grow = blocks_for(min(request.params.max_tokens, 16 * size), size)
                request.blocks = hit + cache.allocate(new, claim=new + grow)
                request.cached = len(hit) * size
                request.registered = len(hit)
                if self.offload is not None and len(hit) < len(keys):
                    self._load(request, len(keys))
                if not request.preemptions:
                    request.cached_prompt_tokens = request.cached
                admitted.append(self.queue.pop_head())
        return admitted

    def _load(self, request: Request, wanted: int) -> None:
        """Read the blocks of the request's prompt found on disk after its cached prefix (up
        to `wanted`) into its blocks, and offer them to the prefix cache as computed."""
        assert self.offload is not None
        loaded = self.offload.load(request, request.registered, wanted)
        if loaded:
            request.cached += loaded * self.allocator.block_size
            self._register(request)

    def _another_adapter(self, request: Request, admitted: list[Request]) -> bool:
        """Whether `request` would bring a LoRA adapter past --max-loras in a step."""
        if not self.max_loras or not request.adapter:
            return False
        adapters = {r.adapter for r in (*self.running, *admitted) if r.adapter}
        return request.adapter not in adapters and len(adapters) >= self.max_loras

    def _grow(self, schedule: Schedule) -> None:
        """Give each decoding row, in order, the block its next token needs; when none is
        available, preempt the last running row in order (the row itself, if it is that)."""
        rows = self.running
        size = self.allocator.block_size
        i = 0
        while i < len(rows):
            request = rows[i]
            if request.cached < len(request.blocks) * size:  # prompts got theirs at admission
                i += 1
                continue
            while not self.allocator.available:
                last = max(rows, key=order)
                if last is request:
                    break
                if rows.index(last) < i:  # a row before this one: the list shifts
                    i -= 1
                self._preempt(last, schedule)
            if not self.allocator.available:
                self._preempt(request, schedule)
                continue
            after = request.blocks[-1] if request.blocks else None
            request.blocks.extend(self.allocator.allocate(1, after))
            i += 1

    def _preempt(self, request: Request, schedule: Schedule) -> None:
        """Take the row out of the batch, free its blocks and queue it to be recomputed, in
        its place in order (past the waiting limit: it was admitted once)."""
        self.running.remove(request)
        self.free(request)
        request.cached = request.registered = 0
        request.preemptions += 1
        schedule.preempted.append(request)
        self.queue.requeue(request)

    def _plan(self, schedule: Schedule) -> None:
        """Every decoding row one token (some with drafts to verify), then prompt chunks
        within the budget."""
        budget = self.max_step_tokens
        decoding: list[Request] = []
        prefilling: list[Request] = []
        for request in self.running:
            if request.finish_reason is None:
                (prefilling if request.prefilling else decoding).append(request)
        drafts = self._drafts(decoding, budget) if not prefilling else {}
        verifying = []
        for request in decoding:
            if request.speculation is not None:
                request.speculation.drafts = drafts.get(id(request), [])
                if request.speculation.drafts:
                    verifying.append(request)
                    continue
            schedule.requests.append(request)
            schedule.rows.append(
                StepRow(
                    request.blocks,
                    request.cached,
                    request.output_ids[-1:],
                    logits=True,
                    adapter=request.adapter,
                )
            )
            budget -= 1
        schedule.decode_rows = len(schedule.rows)
        for request in verifying:  # the last token and its drafts: logits for every one
            assert request.speculation is not None
            tokens = request.output_ids[-1:] + request.speculation.drafts
            schedule.requests.append(request)
            schedule.rows.append(
                StepRow(
                    request.blocks,
                    request.cached,
                    tokens,
                    True,
                    True,
                    len(tokens) - 1,
                    request.adapter,
                )
            )
            budget -= len(tokens)
        schedule.verify_rows = len(verifying)
        # a step with no row yet feeds at least one prompt token (progress)
        least = budget if schedule.rows else max(budget, 1)
        for request, size in prefill_chunks(prefilling, least):
            total = request.total_tokens
            end = request.cached + size
            chunk = request.tokens(request.cached, end)
            sample_next = end == total and not request.echo_only
            schedule.requests.append(request)
            schedule.rows.append(
                StepRow(
                    request.blocks,
                    request.cached,
                    chunk,
                    sample_next,
                    request.scoring,
                    adapter=request.adapter,
                )
            )

    def _drafts(self, decoding: list[Request], budget: int) -> dict[int, list[int]]:
        """Each decoding row's drafts this step (by id), where the policy says they pay."""
        if self.speculation is None:
            return {}
        return self.speculation.drafts(decoding, budget, self._room)

    def timed(self, schedule: Schedule, seconds: float) -> None:
        """The step of `schedule` took `seconds`: the speculation policy learns from it."""
        if self.speculation is not None:
            self.speculation.timed(schedule, seconds)

    def _room(self, request: Request, wanted: int) -> int:
        """How many draft positions the row's blocks can hold past its next token, taking at
        most one more block when the cache has more than its headroom free (never
        preempting for a draft)."""
        size = self.allocator.block_size
        room = len(request.blocks) * size - request.cached - 1
        headroom = max(1, self.allocator.num_blocks // 100)
        if room < wanted and self.allocator.available > headroom:
            request.blocks.extend(self.allocator.allocate(1, request.blocks[-1]))
            room += size
        return max(0, min(room, wanted))

    def update(self, schedule: Schedule, computed: list[int] | None = None) -> None:
        """Book a forward pass of `schedule`: the rows' cache now holds what they were fed
        (`computed`: how many of each row's tokens count: a verified row's last token and its
        accepted drafts; the rejected drafts' slots are written over later, never read); the
        blocks that filled up are offered to the prefix cache."""
        for i, (request, row) in enumerate(schedule):
            request.cached += len(row.tokens) if computed is None else computed[i]
            if self.prefix_caching:
                self._register(request)

    def _register(self, request: Request) -> None:
        """Offer the row's blocks that are full and computed to the prefix cache."""
        size = self.allocator.block_size
        full = request.cached // size
        if request.registered < full:
            keys = request.block_keys(full, size)
            if self.events is not None:
                self._register_told(request, keys, full)
            elif self.offload is not None:  # the blocks' hashes, for the disk
                hashes = self.offload.hasher.hashes(request, full)
                for i in range(request.registered, full):
                    if self.allocator.register(request.blocks[i], keys[i]):
                        self.allocator.hashed(request.blocks[i], hashes[i])
            else:
                for i in range(request.registered, full):
                    self.allocator.register(request.blocks[i], keys[i])
            request.registered = full

    def _register_told(self, request: Request, keys: list[BlockKey], full: int) -> None:
        """`_register` with KV events: each run of blocks the cache took is one BlockStored
        (a block whose key another block holds already is not stored again)."""
        assert self.events is not None
        cache = self.allocator
        run: list[int] = []  # the blocks of the current run, by index in the row
        for i in range(request.registered, full + 1):
            if i < full and cache.register(request.blocks[i], keys[i]):
                run.append(i)
                continue
            if run:
                hashes = self.events.stored(request, run[0], len(run), request.adapter or None)
                for j, event_hash in zip(run, hashes, strict=True):
                    cache.hashed(request.blocks[j], event_hash)
                run = []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix: refused (False) while a row holds blocks."""
        return self.allocator.reset()

    def preempt_all(self) -> list[Request]:
        """Every running row back to the queue, its blocks freed (the engine falls asleep):
        readmitted, each is recomputed as after any preemption."""
        schedule = Schedule()
        for request in sorted(self.running, key=order, reverse=True):
            self._preempt(request, schedule)
        return schedule.preempted

    def remove_finished(self) -> list[Request]:
        """Drop finished rows, their blocks freed; return them."""
        gone = [r for r in self.running if r.finish_reason is not None]
        if gone:
            self.running = [r for r in self.running if r.finish_reason is None]
            for request in gone:
                self.free(request)
                if self.speculation is not None:
                    self.speculation.finished(request)
        return gone

    def free(self, request: Request) -> None:
        self.allocator.free(request.blocks)
        request.blocks = []


def prefill_chunks(prefilling: list[Request], budget: int) -> list[tuple[Request, int]]:
    """How many prompt tokens each prefilling row feeds this step, within `budget`, in the
    order they go: the prompts with the fewest tokens left first (shortest remaining first:
    a new request's short prompt is not held behind the chunks of a long one that came
    earlier, so its first token comes in the next step, as vLLM's long-prefill threshold and
    llama.cpp's per-slot batches allow), while the longest-waiting row (`prefilling[0]`, first
    admitted) keeps a quarter of the budget each step, so a long prompt always finishes under
    a stream of short ones. A row's tokens do not depend on how its prompt is chunked
    (docs/engine.md, "Determinism"), so the order changes no token."""
    left = {id(r): r.total_tokens - r.cached for r in prefilling}
    granted: dict[int, int] = {}
    if len(prefilling) > 1 and budget > 0:
        oldest = prefilling[0]
        granted[id(oldest)] = min(left[id(oldest)], max(1, budget // 4))
        budget -= granted[id(oldest)]
    # stable: ties in admission order; the oldest's reserve counted as fed
    shortest_first = sorted(prefilling, key=lambda r: left[id(r)] - granted.get(id(r), 0))
    for request in shortest_first:
        if budget <= 0:
            break
        more = min(left[id(request)] - granted.get(id(request), 0), budget)
        granted[id(request)] = granted.get(id(request), 0) + more
        budget -= more
    return [(r, granted[id(r)]) for r in shortest_first if granted.get(id(r), 0) > 0]
