"""A tenant's recent answers, followed in order: the `suffix` proposer's third source.

Answers to one kind of request often share a shape: a JSON object's fields in the same order,
a tool call's arguments, a form letter. After the row's own value for one field, the next
field is what came next in the last answer, which neither the row's own text nor the index of
recent answers (the most frequent, else the latest continuation of a short context such as
`", "`) can tell. A row follows each of its salt's last few answers (`Following`): it drafts
from the first place, after where its text last agreed with the answer, where the longest end
of its text occurs there.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ANSWER_LENGTH = 1024  # an answer's first tokens a row may follow


class Answer:
    """One recent answer (with the few prompt tokens before it), for drafting in order: where
    each context of 1..max_n tokens occurs in it."""

    def __init__(self, tokens: Sequence[int], max_n: int) -> None:
        self.tokens = list(tokens)
        self.max_n = max_n
        self._at: dict[tuple[int, ...], list[int]] = {}
        for j in range(1, len(self.tokens)):
            for n in range(1, min(max_n, j) + 1):
                self._at.setdefault(tuple(self.tokens[j - n : j]), []).append(j)

    def propose(
        self, tokens: Sequence[int], k: int, min_n: int, at: int
    ) -> tuple[list[int], int, int]:
        """Up to k tokens continuing `tokens` from the first place at or after `at` where the
        longest context of the text's end occurs: (drafts, the context's length, the place)."""
        low, high, place = min_n - 1, min(self.max_n, len(tokens)), at
        while low < high:  # a binary search: a context's shorter ends occur where it does
            middle = (low + high + 1) // 2
            places = self._at.get(tuple(tokens[-middle:]), [])
            i = bisect_left(places, at)
            if i < len(places):
                low, place = middle, places[i]
            else:
                high = middle - 1
        if low < min_n:
            return [], 0, at
        return self.tokens[place : place + k], low, place


@dataclass
class Following:
    """A row following a recent answer as it goes: of a context seen at several places in the
    answer (the `", "` between the fields of a JSON answer) it drafts what came at the next
    place after the one it last agreed with, not the latest."""

    answer: Answer
    at: int = 0  # the answer's place the row's text has agreed with up to
    proposed: tuple[int, int, list[int]] = (0, 0, [])  # (text length, place, drafts)

    def propose(self, tokens: Sequence[int], k: int, min_n: int) -> tuple[list[int], int]:
        """Up to k drafts continuing `tokens` from the answer, and the context's length; the
        place followed moves on by as many of the last drafts as the text went on with."""
        start, place, drafts = self.proposed
        agreed = 0
        for token, draft in zip(tokens[start:], drafts, strict=False):  # the shorter
            if token != draft:
                break
            agreed += 1
        if agreed:  # the text went on as the answer did from `place`
            self.at = place + agreed
        drafts, matched, place = self.answer.propose(tokens, k, min_n, self.at)
        self.proposed = (len(tokens), place, drafts)
        return drafts, matched


class RecentAnswers:
    """The latest `per_salt` answers of each salt, `tokens` tokens in all (beyond that the
    oldest answers, of any salt, are dropped): what a new row of that salt follows."""

    def __init__(self, per_salt: int, tokens: int) -> None:
        self.per_salt, self.tokens = per_salt, tokens
        self._by_salt: dict[str | None, list[Answer]] = {}
        self._order: OrderedDict[int, str | None] = OrderedDict()  # id(answer): its salt
        self._held = 0

    def add(self, salt: str | None, answer: Answer) -> None:
        mine = self._by_salt.setdefault(salt, [])
        mine.append(answer)
        self._order[id(answer)] = salt
        self._held += len(answer.tokens)
        if len(mine) > self.per_salt:
            self._drop(salt, mine[0])
        while self._held > self.tokens:
            salt = next(iter(self._order.values()))  # the oldest answer's
            self._drop(salt, self._by_salt[salt][0])

    def _drop(self, salt: str | None, answer: Answer) -> None:
        del self._order[id(answer)]
        self._held -= len(answer.tokens)
        mine = self._by_salt[salt]
        mine.remove(answer)
        if not mine:
            del self._by_salt[salt]

    def of(self, salt: str | None) -> list[Answer]:
        """The salt's answers, the latest first."""
        return self._by_salt.get(salt, [])[::-1]

    def __len__(self) -> int:
        return len(self._order)
