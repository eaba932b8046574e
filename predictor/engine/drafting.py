"""Speculative decoding inside a step: who drafts (`Proposer`) and whether drafts pay
(`Policy`), as one named pair the scheduler holds (`Speculation`).

The scheduler owns the rows and their KV blocks; this owns the drafts: each decoding row's
drafts for a step within the step's spare budget and the room its blocks have (`drafts`), what
the policy learns from each decode step's time (`timed`), and the answers a finished request
leaves for others of its salt to draft from (`finished`). What drafts are and how they are
chosen is speculation.py's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from predictor.engine.request import Request
from predictor.engine.speculation import Policy, Proposer

if TYPE_CHECKING:  # annotations only: the scheduler imports this module
    from predictor.engine.scheduler import Schedule

# (row, drafts wanted) -> how many draft positions its blocks can hold (the scheduler's)
Room = Callable[[Request, int], int]


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding for a scheduler: the proposer drafts, the policy grants."""

    proposer: Proposer
    policy: Policy

    def drafts(self, decoding: list[Request], budget: int, room: Room) -> dict[int, list[int]]:
        """Each decoding row's drafts this step (by id), where the policy says they pay."""
        if not decoding:
            return {}
        proposer, policy = self.proposer, self.policy
        limit = proposer.config.max_tokens
        spare = max(0, budget - len(decoding))
        candidates, offers = [], []
        useful = functools.partial(policy.useful, len(decoding))  # what drafting could pay
        for request in decoding:
            state = request.speculation
            left = request.params.max_tokens - len(request.output_ids) - 1
            if state is None or left <= 0 or spare <= 0:
                continue
            tokens = request.prompt_ids + request.output_ids
            proposed = proposer.propose(state, tokens, request.cache_salt, min(limit, left), useful)
            proposed = proposed[: room(request, len(proposed))]
            if proposed:
                candidates.append((request, proposed))
                offers.append((len(proposed), *state.chances))
        if not candidates:
            return {}
        granted = policy.choose(len(decoding), offers)
        chosen: dict[int, list[int]] = {}
        for (request, proposed), count in zip(candidates, granted, strict=True):
            count = min(count, spare)
            if count:
                chosen[id(request)] = proposed[:count]
                spare -= count
        return chosen

    def timed(self, schedule: Schedule, seconds: float) -> None:
        """The step of `schedule` took `seconds` (its forward pass and sampling): what the
        policy learns a step's cost from (decode steps only: no prompt chunk)."""
        if not schedule.rows:
            return
        rows = schedule.decode_rows + schedule.verify_rows
        if rows == len(schedule.rows):
            self.policy.observe(rows, schedule.tokens - rows, seconds)

    def finished(self, request: Request) -> None:
        """A finished row's answer, for other requests of its salt to draft from."""
        if request.output_ids:
            tokens = request.prompt_ids + request.output_ids
            self.proposer.finished(tokens, len(request.prompt_ids), request.cache_salt)
