"""Incremental detokenizer: releases text as tokens arrive, never half a character, never a stop.

Text that could still grow into a stop string is held back until it cannot; when a stop string
appears, the text before it is released and the request stops.
"""

from __future__ import annotations

import codecs
import random
from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def byte_table(tokenizer: Any, checks: int = 64) -> list[bytes] | None:
    """Each token's bytes, for tokenizers whose decode is plain byte concatenation.

    Byte-level BPE (GPT-2's scheme, SmolLM2's and Llama 3's) decodes a token list by joining
    the tokens' bytes; with this table a request's text grows by one lookup per token instead of
    two tokenizer calls. Special tokens are empty (skip_special_tokens). The table is checked
    against the tokenizer's own decode on random token lists; None when the tokenizer is of
    another kind or any check differs, and the detokenizer then calls decode.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False) or backend.normalizer:
        return None
    byte_of = {char: byte for byte, char in _bytes_to_unicode().items()}
    added = getattr(tokenizer, "added_tokens_decoder", {})
    table: list[bytes] = []
    for token_id, token in enumerate(tokenizer.convert_ids_to_tokens(range(len(tokenizer)))):
        if token_id in added:
            table.append(b"" if added[token_id].special else added[token_id].content.encode())
        elif token is None or any(c not in byte_of for c in token):
            return None
        else:
            table.append(bytes(byte_of[c] for c in token))
    rng = random.Random(0)
    for _ in range(checks):
        ids = [rng.randrange(len(table)) for _ in range(rng.randint(1, 12))]
        joined = b"".join(table[i] for i in ids).decode("utf-8", errors="replace")
        if joined != tokenizer.decode(ids, skip_special_tokens=True):
            return None
    return table


# How many prompt tokens to decode with, so the first generated token keeps its leading space.
_CONTEXT_TOKENS = 5


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, others are shifted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return chars


class IncrementalDetokenizer:
    def __init__(
        self,
        decoder: Decoder,
        prompt_ids: Sequence[int],
        stop: Sequence[str],
        table: list[bytes] | None = None,
        keep: Mapping[int, str] | None = None,
    ) -> None:
        """`keep`: special tokens whose text stays in the text (a tool format's markers), where
        every other special token is left out."""
        self._decoder = decoder
        self._table = table  # byte_table(tokenizer): one lookup per token instead of decode
        self._keep = keep or {}
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(s for s in stop if s)
        self._pending = ""  # decoded, not yet released
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, token_id: int, check_stop: bool = True) -> str:
        """Add one generated token; return the text that may be released now.

        With check_stop False (a request short of its min_tokens) stop strings are not looked
        for: the text so far is released whole.
        """
        if self.stopped:
            return ""
        if token_id in self._keep:
            self._pending += self._utf8.decode(self._keep[token_id].encode())
            if self._table is None:  # the token goes on as the next text's context only
                self._ids.append(token_id)
                self._prefix_offset, self._read_offset = len(self._ids) - 1, len(self._ids)
        elif self._table is not None:
            self._pending += self._utf8.decode(self._table[token_id])
        else:
            self._ids.append(token_id)
            self._pending += self._decode_delta()
        if not check_stop:
            text, self._pending = self._pending, ""
            return text
        return self._release(final=False)

    def token_text(self, token_id: int) -> str:
        """One token's own text (logprobs report it), special tokens included."""
        return self._decoder.decode([token_id], skip_special_tokens=False)

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
            hits = [(i, s) for s in self._stop if (i := text.find(s)) >= 0]
            if hits:
                cut, self.matched = min(hits, key=lambda hit: hit[0])  # the first to appear
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
