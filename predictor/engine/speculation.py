"""Draft tokens without a draft model, and when drafting pays.

A decode row may feed its last token plus k draft tokens; the step verifies them all in one
forward pass (the weights are read once for every row) and keeps the drafts the model itself
would have produced. Drafts come from the request's own text or recent answers:

- `ngram` (vLLM's prompt lookup, `prompt_lookup_min/max`): the longest suffix of the request's
  prompt + output (up to `max_n` tokens) that occurred before in it; the tokens that followed
  its latest occurrence.
- `suffix` (SuffixDecoding's idea, bounded): the same over the request's own tokens and over a
  bounded global index of recent requests' answers, one per `cache_salt` so tenants never draft
  from each other's text (the continuation most often seen after the longest matching context);
  and the salt's last few answers followed in order (`Following`: where answers share a shape,
  a JSON object's fields, a tool call's arguments, the field after this one is the one that
  came next in the last answer, which neither the latest nor the most frequent continuation
  of a short context such as `", "` knows); of these, the one whose kind of match has been
  accepted most often.

Draft length adapts per row: a proposer drafts as far as the matched continuation goes (up to
--num-speculative-tokens), and `Policy` keeps a row's drafts while each, as likely as drafts of
its kind (`Acceptance`: its source and how long a context matched) have been accepted, adds
tokens faster than the step makes them: what a step costs is measured on the steps themselves,
so under load (many rows, where an extra token a row is no longer nearly free) and on text with
nothing to copy speculation switches itself off.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from predictor.engine.recent_answers import ANSWER_LENGTH, Answer, Following, RecentAnswers


@dataclass(frozen=True)
class SpeculationConfig:
    mode: str = "ngram"  # one of config.SPECULATIVE but off
    max_tokens: int = 4  # draft tokens a row proposes at most (--num-speculative-tokens)
    min_n: int = 1  # shortest context that may match (Acceptance weighs what each is worth)
    max_n: int = 8  # longest context matched
    global_entries: int = 100_000  # contexts the global index holds (all salts), LRU beyond
    answers: int = 3  # recent answers a row follows in order, per salt (`suffix`)
    answer_tokens: int = 16_384  # tokens those answers hold (all salts), the oldest dropped


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
        self, context: Sequence[int], shortest: int, longest: int, scope: tuple[object, ...]
    ) -> tuple[dict[int, int] | None, int]:
        """The next-token counts of the longest context ending `context`, `shortest` to
        `longest` tokens long, that was seen, and its length."""
        for n in range(min(len(context), longest), shortest - 1, -1):
            counts = self._next.get((*scope, *context[-n:]))
            if counts:
                return counts, n
        return None, 0

    def match(self, tokens: Sequence[int], shortest: int, scope: tuple[object, ...] = ()) -> int:
        """The length of the longest end of `tokens` (`shortest` to max_n tokens) seen as a
        context, 0 if none: `add` files every shorter end of a context too, so a binary
        search finds it."""
        low, high = shortest - 1, min(self.max_n, len(tokens))  # low: seen (or too short)
        while low < high:
            middle = (low + high + 1) // 2
            if (*scope, *tokens[-middle:]) in self._next:
                low = middle
            else:
                high = middle - 1
        return low if low >= shortest else 0

    def propose(
        self, tokens: Sequence[int], k: int, min_n: int, scope: tuple[object, ...] = ()
    ) -> tuple[list[int], int]:
        """Up to k tokens continuing `tokens`, and the length of the context that matched."""
        matched = self.match(tokens, min_n, scope)
        return self.continuation(tokens, matched, k, min_n, scope), matched

    def continuation(
        self,
        tokens: Sequence[int],
        matched: int,
        k: int,
        min_n: int,
        scope: tuple[object, ...] = (),
    ) -> list[int]:
        """Up to k tokens continuing `tokens`, whose last `matched` tokens (`match`) were seen
        as a context."""
        if not matched:
            return []
        context = list(tokens[-matched:])
        drafts: list[int] = []
        length = matched - 1
        while len(drafts) < k:
            # a context of n + 1 tokens seen means its first n were seen before its last: at
            # most one token longer than the last draft's
            counts, length = self._longest(context, min(min_n, len(context)), length + 1, scope)
            if not counts:
                break
            token = max(reversed(counts), key=counts.__getitem__)  # ties: the latest
            drafts.append(token)
            context.append(token)
        return drafts


class Acceptance:
    """How likely drafts of each kind are to be accepted, learnt from the drafts verified: per
    kind (where they came from, how long a context matched: a span found at its 8th token of
    context is copied on, one matched on a single token is a guess), the chance that a row's
    first draft is accepted, and that a later one is, given those before it were. Replayed over
    this project's prompts (load/speculation/, every kind in turn; first, later): the row's own
    text matched on 8 tokens 0.96, 0.98; on 4-7 tokens 0.77, 0.88; on one token 0.41, 0.56;
    recent answers matched on 8 tokens 0.77, 0.78, on one token 0.13. Shared by every row,
    recent drafts weighing most, so what a workload copies (and what it does not: free chat)
    carries to its next rows."""

    def __init__(self, prior: float = 0.5, weight: float = 2.0, decay: float = 0.98) -> None:
        self.prior, self.weight, self.decay = prior, weight, decay
        # kind -> (first drafts accepted, verified, later drafts accepted, verified)
        self._counts: dict[object, tuple[float, float, float, float]] = {}

    def chances(self, kind: object) -> tuple[float, float]:
        """(first draft accepted, a later one accepted given those before it were)."""
        first, firsts, later, laters = self._counts.get(kind, (0.0, 0.0, 0.0, 0.0))
        prior, weight = self.prior * self.weight, self.weight
        return (first + prior) / (firsts + weight), (later + prior) / (laters + weight)

    def observe(self, kind: object, proposed: int, accepted: int) -> None:
        """`proposed` drafts of `kind` verified, the first `accepted` of them kept."""
        verified = min(proposed, accepted + 1)  # up to the first rejected one
        first, firsts, later, laters = self._counts.get(kind, (0.0, 0.0, 0.0, 0.0))
        d = self.decay
        self._counts[kind] = (
            d * first + (accepted > 0),
            d * firsts + 1,
            d * later + max(0, accepted - 1),
            d * laters + verified - 1,
        )


@dataclass
class RowSpeculation:
    """One request's drafting state."""

    own: ContextIndex
    rates: Acceptance  # every row's, by kind of draft
    indexed: int = 0  # tokens of prompt + output indexed so far
    drafts: list[int] = field(default_factory=list)  # this step's, verified by the step loop
    kind: object = None  # where this step's drafts came from (Acceptance's key)
    following: list[Following] | None = None  # its salt's recent answers when it began

    @property
    def chances(self) -> tuple[float, float]:
        """The chances that this step's first draft is accepted, and a later one given those
        before it were."""
        return self.rates.chances(self.kind)

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.rates.observe(self.kind, proposed, accepted)


class Proposer:
    """Draft tokens for a row, from its own text (and, in `suffix` mode, recent answers): of
    the continuations found, the one whose kind of match is the most often accepted."""

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config
        # recent answers of every tenant, filed under its salt: bounded as a whole
        self._global = ContextIndex(config.max_n, config.global_entries)
        self.rates = Acceptance()
        self._answers = RecentAnswers(config.answers, config.answer_tokens)

    def state(self) -> RowSpeculation:
        return RowSpeculation(ContextIndex(self.config.max_n), self.rates)

    def propose(
        self,
        state: RowSpeculation,
        tokens: Sequence[int],
        salt: str | None,
        limit: int,
        useful: Callable[[float, float], int] | None = None,
    ) -> list[int]:
        """Up to `limit` drafts continuing `tokens` (the row's prompt + output so far); no
        more than `useful` says could be granted to drafts as likely as this kind's (its
        chances of a first and a later draft accepted; `Policy.useful`): the drafting is what
        costs, most rows at a busy step are granted none."""
        config = self.config
        # the row's own index holds every context that ends before its last token
        state.own.add(tokens[: len(tokens) - 1], state.indexed)
        state.indexed = max(state.indexed, len(tokens) - 1)
        found = [("own", state.own.match(tokens, config.min_n))]
        answer: list[int] = []  # the drafts of the answer followed that matched longest
        scope = (salt,)
        if config.mode == "suffix":
            if state.following is None:
                state.following = [Following(recent) for recent in self._answers.of(salt)]
            longest = 0
            for following in state.following:  # the latest first: of equals, it drafts
                drafts, length = following.propose(tokens, limit, config.min_n)
                if drafts and length > longest:
                    answer, longest = drafts, length
            found.append(("answer", longest))
            found.append(("global", self._global.match(tokens, config.min_n, scope)))
        best, best_score = "", (-1.0, 0)
        for source, matched in found:  # a context matched has a continuation
            kind = (source, self._length_class(matched))
            score = (self.rates.chances(kind)[0], matched)  # of equal chances, the longer
            if matched and score > best_score:  # of equals, the row's own
                best, best_score, state.kind = source, score, kind
        if not best:
            return []
        if useful is not None:
            limit = min(limit, max(1, useful(*self.rates.chances(state.kind))))
        matched = best_score[1]
        if best == "own":
            return state.own.continuation(tokens, matched, limit, config.min_n)
        if best == "answer":
            return answer[:limit]
        return self._global.continuation(tokens, matched, limit, config.min_n, scope)

    def _length_class(self, matched: int) -> int:
        """The matched context's length as Acceptance files it: 1, 2, 3, 4 (4 up to max_n - 1)
        or max_n."""
        return matched if matched < 4 or matched == self.config.max_n else 4

    def finished(self, tokens: Sequence[int], prompt_length: int, salt: str | None) -> None:
        """Remember a finished request's answer for other requests of the same salt."""
        if self.config.mode == "suffix":
            self._global.add(tokens, max(1, prompt_length), (salt,))
            lead = max(0, prompt_length - self.config.max_n)  # the answer's first context
            end = prompt_length + ANSWER_LENGTH
            self._answers.add(salt, Answer(tokens[lead:end], self.config.max_n))


# (fed tokens, logit rows) -> seconds of a step's matmuls as measured (None: not measured)
StepCost = Callable[[int, int], float | None]


class Policy:
    """How many drafts each row verifies this step: drafts are granted one at a time, the
    likeliest to be accepted first (a row's j-th draft counts only if its j - 1 before it
    are accepted: first * later ** (j - 1), as `Acceptance` has them), while each one adds
    tokens faster than the step makes them.

    What a step costs is learnt from the steps themselves (the step loop reports each decode
    step's seconds): a plain step of so many rows, the seconds a draft token adds to it, and
    what a step with any drafts costs on top (a straight line fitted to the recent steps: the
    one-draft steps of a guessing row cost more a draft than the eight-draft steps of a copy,
    whose average alone would grant guesses too cheaply).
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
        if margin < 1.0:  # `useful` bounds what `choose` grants only with margin >= 1
            raise ValueError(f"margin must be at least 1, not {margin}")
        self._prior = cost
        self.margin = margin  # a draft must add tokens this much faster than the step's rate
        self.explore_every = explore_every
        self._plain: dict[int, float] = {}  # rows -> seconds of a step without drafts
        self._per_draft: dict[int, float] = {}  # rows -> seconds a draft token adds
        self._first: dict[int, float] = {}  # rows -> seconds a step's first draft adds more
        # rows -> decayed sums (n, k, k * k, extra, k * extra) of the drafted steps' draft
        # counts k and the seconds they added: extra = first + k * per_draft, fitted
        self._fits: dict[int, tuple[float, float, float, float, float]] = {}
        self._declined = 0

    def observe(self, rows: int, drafts: int, seconds: float) -> None:
        """A decode step of `rows` rows verifying `drafts` draft tokens took `seconds`."""
        if not drafts:
            self._plain[rows] = _average(self._plain.get(rows), seconds)
        elif rows in self._plain:
            extra = max(0.0, seconds - self._plain[rows])
            n, k, kk, y, ky = (0.8 * v for v in self._fits.get(rows, (0.0,) * 5))  # recent first
            n, k, kk, y, ky = n + 1, k + drafts, kk + drafts**2, y + extra, ky + drafts * extra
            self._fits[rows] = (n, k, kk, y, ky)
            spread = kk / n - (k / n) ** 2  # of the draft counts
            slope = (ky / n - k / n * y / n) / spread if spread > 0.25 else y / k
            slope = min(max(slope, 0.0), y / k)  # noise: a draft never costs less than nothing
            self._per_draft[rows] = slope
            self._first[rows] = max(0.0, (y - slope * k) / n)

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

    def first_draft(self, rows: int) -> float:
        """Seconds a step of `rows` rows with any drafts costs on top of its drafts' own (the
        verification's fixed work), as measured at that many rows (else 0)."""
        return self._first.get(rows, 0.0)

    def useful(self, rows: int, first: float, later: float) -> int:
        """How many drafts of a row, its first accepted with chance `first` and each later
        one with `later`, `choose` could grant at most at `rows` rows: a draft is granted only
        while its gain beats the step's rate times the margin, and each granted draft raises
        that rate (the margin is at least 1). 1 until a plain step of so many rows is
        measured."""
        if rows not in self._plain:
            return 1
        least = self.margin * self.per_draft(rows) * rows / self.plain(rows)
        count, gain = 0, first
        while gain > least and count < 64:
            count += 1
            gain *= later
        return count

    def choose(self, rows: int, offers: Sequence[tuple[int, float, float]]) -> list[int]:
        """`offers`: per candidate row, (drafts it has, the chance its first is accepted, and
        a later one given those before it were). Returns how many of its drafts each row
        verifies."""
        granted = [0] * len(offers)
        if rows not in self._plain:
            return granted  # first a plain step of so many rows, to measure
        gains = sorted(
            (
                (first * later ** (j - 1), i)
                for i, (count, first, later) in enumerate(offers)
                for j in range(1, count + 1)
            ),
            reverse=True,
        )
        if not gains:
            return granted
        tokens, seconds, extra = float(rows), self.plain(rows), self.per_draft(rows)
        fixed = self.first_draft(rows)  # what the step's first draft costs more
        for gain, i in gains:
            cost = extra + fixed
            if gain * seconds <= self.margin * cost * tokens:
                break  # this draft (and every later one) slows the step's tokens per second
            granted[i] += 1
            tokens += gain
            seconds += cost
            fixed = 0.0
        if not any(granted):
            self._declined += 1
            if self._declined >= self.explore_every:  # measure again what a draft costs
                self._declined = 0
                granted[gains[0][1]] = 1
        return granted


def _average(before: float | None, now: float, weight: float = 0.2) -> float:
    return now if before is None else (1 - weight) * before + weight * now
