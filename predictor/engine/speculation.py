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

Draft length adapts per row: to the match (a longer matched context drafts more) and to the
row's recent acceptance. `Policy` decides whether a step drafts at all: it compares the step's
expected tokens per second with and without drafts, using what the runner measured a step of
so many fed tokens costs on this machine, so under load (many rows, where an extra token a row is
no longer nearly free) speculation switches itself off.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpeculationConfig:
    mode: str = "ngram"  # one of config.SPECULATIVE but off
    max_tokens: int = 4  # draft tokens a row proposes at most (--num-speculative-tokens)
    min_n: int = 2  # shortest context that may match
    max_n: int = 8  # longest context matched
    global_entries: int = 100_000  # contexts the global (per salt) index holds, LRU beyond


class ContextIndex:
    """For each context of 1..max_n tokens seen, the counts of the token that followed it
    (a suffix trie of bounded depth, flattened): `propose` follows the longest context that
    matches the text's end, then its most frequent next token (of equals, the latest seen),
    for up to k tokens."""

    def __init__(self, max_n: int, max_entries: int | None = None) -> None:
        self.max_n = max_n
        self.max_entries = max_entries
        self._next: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def add(self, tokens: Sequence[int], start: int = 1) -> None:
        """Index the token at each position from `start` after the contexts ending before it."""
        for i in range(max(1, start), len(tokens)):
            after = tokens[i]
            for n in range(1, min(self.max_n, i) + 1):
                context = tuple(tokens[i - n : i])
                counts = self._next.get(context)
                if counts is None:
                    counts = self._next[context] = {}
                elif self.max_entries is not None:
                    self._next.move_to_end(context)
                counts[after] = counts.pop(after, 0) + 1  # the latest seen last
        if self.max_entries is not None:
            while len(self._next) > self.max_entries:
                self._next.popitem(last=False)

    def _longest(self, context: Sequence[int], shortest: int) -> dict[int, int] | None:
        """The next-token counts of the longest context ending `context` (at least
        `shortest` tokens long) that was seen."""
        for n in range(min(len(context), self.max_n), shortest - 1, -1):
            counts = self._next.get(tuple(context[-n:]))
            if counts:
                return counts
        return None

    def propose(self, tokens: Sequence[int], k: int, min_n: int) -> tuple[list[int], int]:
        """Up to k tokens continuing `tokens`, and the length of the context that matched."""
        matched = 0
        for n in range(min(self.max_n, len(tokens)), min_n - 1, -1):
            if tuple(tokens[-n:]) in self._next:
                matched = n
                break
        if not matched:
            return [], 0
        context = list(tokens[-matched:])
        drafts: list[int] = []
        while len(drafts) < k:
            counts = self._longest(context, min(min_n, len(context)))
            if not counts:
                break
            token = max(reversed(counts), key=counts.__getitem__)  # ties: the latest
            drafts.append(token)
            context.append(token)
        return drafts, matched


@dataclass
class RowSpeculation:
    """One request's drafting state."""

    own: ContextIndex
    indexed: int = 0  # tokens of prompt + output indexed so far
    acceptance: float = 0.7  # running acceptance rate of its drafts (optimistic start)
    drafts: list[int] = field(default_factory=list)  # this step's, verified by the step loop

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.acceptance = 0.7 * self.acceptance + 0.3 * accepted / proposed


class Proposer:
    """Draft tokens for a row, from its own text (and, in `suffix` mode, recent answers)."""

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config
        self._global: dict[str | None, ContextIndex] = {}

    def state(self) -> RowSpeculation:
        return RowSpeculation(ContextIndex(self.config.max_n))

    def propose(
        self, state: RowSpeculation, tokens: Sequence[int], salt: str | None, limit: int
    ) -> list[int]:
        """Up to `limit` drafts continuing `tokens` (the row's prompt + output so far)."""
        config = self.config
        # the row's own index holds every context that ends before its last token
        state.own.add(tokens[: len(tokens) - 1], state.indexed)
        state.indexed = max(state.indexed, len(tokens) - 1)
        drafts, matched = state.own.propose(tokens, limit, config.min_n)
        if not drafts and config.mode == "suffix":
            index = self._global.get(salt)
            if index is not None:
                drafts, matched = index.propose(tokens, limit, config.min_n)
        if not drafts:
            return []
        # a longer match and a row whose drafts were accepted draft more
        length = min(limit, max(1, round((matched / config.max_n + state.acceptance) * limit)))
        return drafts[:length]

    def finished(self, tokens: Sequence[int], prompt_length: int, salt: str | None) -> None:
        """Remember a finished request's answer for other requests of the same salt."""
        if self.config.mode != "suffix":
            return
        index = self._global.get(salt)
        if index is None:
            index = self._global[salt] = ContextIndex(self.config.max_n, self.config.global_entries)
        index.add(tokens, max(1, prompt_length))


# (fed tokens, logit rows) -> seconds of a step's matmuls as measured (None: not measured)
StepCost = Callable[[int, int], float | None]


class Policy:
    """Whether a step drafts: its expected tokens per second with the drafts against without,
    from the runner's measured cost of a step of so many fed tokens and logit rows (where the
    runner measured none: a step costing 10% more per extra token, a CPU's small batches)."""

    def __init__(self, cost: StepCost | None, margin: float = 1.05) -> None:
        self._cost = cost
        self.margin = margin  # drafts must promise this much more throughput

    def cost(self, fed: int, logit_rows: int) -> float:
        measured = self._cost(fed, logit_rows) if self._cost is not None else None
        return measured if measured is not None else 1.0 + 0.1 * (fed - 1)

    def choose(self, fed: int, rows: int, offers: Sequence[tuple[int, float]]) -> list[int]:
        """`offers`: per candidate row, (draft tokens, expected accepted). Returns how many
        drafts each row gets: rows are taken, best expected acceptance first, while the step's
        expected throughput rises."""
        base = rows / self.cost(fed, rows)
        order = sorted(range(len(offers)), key=lambda i: -offers[i][1] / max(offers[i][0], 1))
        granted = [0] * len(offers)
        tokens, extra_fed, extra_logits = float(rows), 0, 0
        best = base
        for i in order:
            drafts, expected = offers[i]
            if not drafts:
                continue
            candidate = (tokens + expected) / self.cost(
                fed + extra_fed + drafts, rows + extra_logits + drafts
            )
            if candidate <= best:
                continue
            granted[i] = drafts
            tokens += expected
            extra_fed += drafts
            extra_logits += drafts
            best = candidate
        if best < base * self.margin:
            return [0] * len(offers)
        return granted


def expected_accepted(drafts: int, acceptance: float) -> float:
    """Tokens expected from `drafts` drafts when each is accepted with `acceptance` in turn."""
    total, chance = 0.0, 1.0
    for _ in range(drafts):
        chance *= acceptance
        total += chance
    return total
