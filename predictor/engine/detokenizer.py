"""Incremental detokenizer: releases text as tokens arrive, never half a character, never a stop.

Text that could still grow into a stop string is held back until it cannot; when a stop string
appears, the text before it is released and the request stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


# How many prompt tokens to decode with, so the first generated token keeps its leading space.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, decoder: Decoder, prompt_ids: Sequence[int], stop: Sequence[str]) -> None:
        self._decoder = decoder
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(s for s in stop if s)
        self._pending = ""  # decoded, not yet released
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that may be released now."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        self._pending += self._decode_delta()
        return self._release(final=False)

    def flush(self) -> str:
        """The request ends (length or eos): release what was held back for stop prefixes."""
        if self.stopped:
            return ""
        return self._release(final=True)

    def _decode_delta(self) -> str:
        prefix = self._decoder.decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full = self._decoder.decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""  # an incomplete multi-byte character: wait for the next token

    def _release(self, final: bool) -> str:
        text = self._pending
        if self._stop:
            cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped = True
                self._pending = ""
                return text[:cut]
            if not final:
                hold = _longest_stop_prefix_suffix(text, self._stop)
                self._pending = text[len(text) - hold :] if hold else ""
                return text[: len(text) - hold]
        self._pending = ""
        return text


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
