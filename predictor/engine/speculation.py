"""Draft tokens without a draft model, and when drafting pays.

A decode row may feed its last token plus k draft tokens; the step verifies them all in one
forward pass (the weights are read once for every row) and keeps the drafts the model itself
would have produced. Drafts come from the request's own text or recent answers:

- `ngram` (vLLM's prompt lookup, `prompt_lookup_min/max`): the longest suffix of the request's
  prompt + output (up to `max_n` tokens) that occurred before in it; the tokens that followed
  its latest occurrence.
- `suffix` (SuffixDecoding's idea, bounded): the same over the request's own tokens, then over a
  bounded global index of recent requests' answers, one per `cache_salt` so tenants never draft
  from each other's text; the continuation most often seen after the longest matching context.

Draft length adapts per row: a proposer drafts as far as the matched continuation goes (up to
--num-speculative-tokens), and `Policy` keeps a row's drafts while each, as likely as the row's
recent acceptance makes it, adds tokens faster than the step makes them: what a step costs is
measured on the steps themselves, so under load (many rows, where an extra token a row is no
longer nearly free) and on text with nothing to copy speculation switches itself off.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpeculationConfig:
    mode: str = "ngram"  # one of config.SPECULATIVE but off
    max_tokens: int = 4  # draft tokens a row proposes at most (--num-speculative-tokens)
    min_n: int = 2  # shortest context that may match
    max_n: int = 8  # longest context matched
    global_entries: int = 100_000  # contexts the global index holds (all salts), LRU beyond


class ContextIndex:
    """For each context of 1..max_n tokens seen, the counts of the token that followed it
    (a suffix trie of bounded depth, flattened): `propose` follows the longest context that
    matches the text's end, then its most frequent next token (of equals, the latest seen),
    for up to k tokens. `scope`: a key the contexts are filed under (a tenant's salt: one
    bounded index holds every tenant's, none reads another's)."""

    def __init__(self, max_n: int, max_entries: int | None = None) -> None:
        self.max_n = max_n
        self.max_entries = max_entries
        self._next: OrderedDict[tuple[object, ...], dict[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def add(self, tokens: Sequence[int], start: int = 1, scope: tuple[object, ...] = ()) -> None:
        """Index the token at each position from `start` after the contexts ending before it."""
        for i in range(max(1, start), len(tokens)):
            after = tokens[i]
            for n in range(1, min(self.max_n, i) + 1):
                context = (*scope, *tokens[i - n : i])
                counts = self._next.get(context)
                if counts is None:
                    counts = self._next[context] = {}
                elif self.max_entries is not None:
                    self._next.move_to_end(context)
                counts[after] = counts.pop(after, 0) + 1  # the latest seen last
        if self.max_entries is not None:
            while len(self._next) > self.max_entries:
                self._next.popitem(last=False)

    def _longest(
        self, context: Sequence[int], shortest: int, scope: tuple[object, ...]
    ) -> dict[int, int] | None:
        """The next-token counts of the longest context ending `context` (at least
        `shortest` tokens long) that was seen."""
        for n in range(min(len(context), self.max_n), shortest - 1, -1):
            counts = self._next.get((*scope, *context[-n:]))
            if counts:
                return counts
        return None

    def propose(
        self, tokens: Sequence[int], k: int, min_n: int, scope: tuple[object, ...] = ()
    ) -> tuple[list[int], int]:
        """Up to k tokens continuing `tokens`, and the length of the context that matched."""
        matched = 0
        for n in range(min(self.max_n, len(tokens)), min_n - 1, -1):
            if (*scope, *tokens[-n:]) in self._next:
                matched = n
                break
        if not matched:
            return [], 0
        context = list(tokens[-matched:])
        drafts: list[int] = []
        while len(drafts) < k:
            counts = self._longest(context, min(min_n, len(context)), scope)
            if not counts:
                break
            token = max(reversed(counts), key=counts.__getitem__)  # ties: the latest
            drafts.append(token)
            context.append(token)
        return drafts, matched


class Acceptance:
    """The acceptance rate of recent drafts over all rows: where a new row's estimate starts
    (a workload that copies little, free chat, starts its rows doubtful)."""

    def __init__(self, rate: float = 0.5) -> None:
        self.rate = rate

    def observe(self, proposed: int, accepted: int) -> None:
        self.rate = 0.9 * self.rate + 0.1 * accepted / proposed


@dataclass
class RowSpeculation:
    """One request's drafting state."""

    own: ContextIndex
    acceptance: float  # running acceptance rate of its drafts (from the recent rows' at first)
    recent: Acceptance  # every row's, this one's drafts included
    indexed: int = 0  # tokens of prompt + output indexed so far
    drafts: list[int] = field(default_factory=list)  # this step's, verified by the step loop

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.acceptance = 0.7 * self.acceptance + 0.3 * accepted / proposed
            self.recent.observe(proposed, accepted)


class Proposer:
    """Draft tokens for a row, from its own text (and, in `suffix` mode, recent answers)."""

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config
        # recent answers of every tenant, filed under its salt: bounded as a whole
        self._global = ContextIndex(config.max_n, config.global_entries)
        self.recent = Acceptance()

    def state(self) -> RowSpeculation:
        return RowSpeculation(ContextIndex(self.config.max_n), self.recent.rate, self.recent)

    def propose(
        self, state: RowSpeculation, tokens: Sequence[int], salt: str | None, limit: int
    ) -> list[int]:
        """Up to `limit` drafts continuing `tokens` (the row's prompt + output so far)."""
        config = self.config
        # the row's own index holds every context that ends before its last token
        state.own.add(tokens[: len(tokens) - 1], state.indexed)
        state.indexed = max(state.indexed, len(tokens) - 1)
        drafts, _ = state.own.propose(tokens, limit, config.min_n)
        if not drafts and config.mode == "suffix":
            drafts, _ = self._global.propose(tokens, limit, config.min_n, (salt,))
        return drafts

    def finished(self, tokens: Sequence[int], prompt_length: int, salt: str | None) -> None:
        """Remember a finished request's answer for other requests of the same salt."""
        if self.config.mode == "suffix":
            self._global.add(tokens, max(1, prompt_length), (salt,))


# (fed tokens, logit rows) -> seconds of a step's matmuls as measured (None: not measured)
StepCost = Callable[[int, int], float | None]


class Policy:
    """How many drafts each row verifies this step: drafts are granted one at a time, the
    likeliest to be accepted first (a row's j-th draft counts only if its j - 1 before it
    are accepted: acceptance ** j), while each one adds tokens faster than the step makes them.

    What a step costs is learnt from the steps themselves (the step loop reports each decode
    step's seconds): a plain step of so many rows, and the seconds a draft token adds to it.
    No drafts until a plain step of so many rows is measured; until a drafted one is: the
    runner's figures for its matmuls (`StepCost`), else a draft costing 10% of a step.
    Attention, sampling and the rest of a step are not in those figures (a draft costs 2-4x
    what its matmuls say), so the learnt figures soon take over. A declined offer is tried
    anyway once in `explore_every` (one draft), so a figure measured in a noisy moment does not
    switch drafting off for good.
    """

    def __init__(
        self, cost: StepCost | None, margin: float = 1.05, explore_every: int = 64
    ) -> None:
        self._prior = cost
        self.margin = margin  # a draft must add tokens this much faster than the step's rate
        self.explore_every = explore_every
        self._plain: dict[int, float] = {}  # rows -> seconds of a step without drafts
        self._per_draft: dict[int, float] = {}  # rows -> seconds a draft token adds
        self._declined = 0

    def observe(self, rows: int, drafts: int, seconds: float) -> None:
        """A decode step of `rows` rows verifying `drafts` draft tokens took `seconds`."""
        if not drafts:
            self._plain[rows] = _average(self._plain.get(rows), seconds)
        elif rows in self._plain:
            extra = max(0.0, seconds - self._plain[rows]) / drafts
            self._per_draft[rows] = _average(self._per_draft.get(rows), extra)

    def plain(self, rows: int) -> float:
        """Seconds of a step of `rows` decode rows without drafts."""
        if rows in self._plain:
            return self._plain[rows]
        prior = self._prior(rows, rows) if self._prior is not None else None
        return prior if prior is not None else 1.0

    def per_draft(self, rows: int) -> float:
        """Seconds one draft token adds to a step of `rows` rows: measured at that many rows,
        else at the nearest count measured, else the prior."""
        if self._per_draft:
            nearest = min(self._per_draft, key=lambda r: abs(math.log(r / rows)))
            if abs(math.log(nearest / rows)) <= math.log(2) or self._prior is None:
                return self._per_draft[nearest]
        if self._prior is not None:
            before, after = self._prior(rows, rows), self._prior(rows + 1, rows + 1)
            if before is not None and after is not None:
                return max(after - before, 0.0)
        return 0.1 * self.plain(rows)

    def choose(self, rows: int, offers: Sequence[tuple[int, float]]) -> list[int]:
        """`offers`: per candidate row, (drafts it has, its acceptance rate). Returns how
        many of its drafts each row verifies."""
        granted = [0] * len(offers)
        if rows not in self._plain:
            return granted  # first a plain step of so many rows, to measure
        gains = sorted(
            ((acceptance**j, i) for i, (count, acceptance) in enumerate(offers)
             for j in range(1, count + 1)),
            reverse=True,
        )  # fmt: skip
        if not gains:
            return granted
        tokens, seconds, extra = float(rows), self.plain(rows), self.per_draft(rows)
        for gain, i in gains:
            if gain * seconds <= self.margin * extra * tokens:
                break  # this draft (and every later one) slows the step's tokens per second
            granted[i] += 1
            tokens += gain
            seconds += extra
        if not any(granted):
            self._declined += 1
            if self._declined >= self.explore_every:  # measure again what a draft costs
                self._declined = 0
                granted[gains[0][1]] = 1
        return granted


def _average(before: float | None, now: float, weight: float = 0.2) -> float:
    return now if before is None else (1 - weight) * before + weight * now
