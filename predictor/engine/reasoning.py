"""Reasoning: a thinking model's `<think>...</think>` text split from its answer.

A format is chosen once at start from the checkpoint (its chat template and its tokenizer's
vocabulary), or named by `--reasoning-parser` (vLLM's names). Per request, `Thinking` follows
the generated tokens (is the model thinking now, how many thinking tokens so far, has the
thinking budget run out) and a `Splitter`, a pure state machine over the released text, cuts
each piece of text into its reasoning and its answer. A grammar and tool-call parsing apply to
the answer only: while the model thinks its grammar waits (`Thinking.pending`), and when its
first token may open the thinking, that token is allowed beside the grammar's (`OpenOrGrammar`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from predictor.config import REASONING_PARSERS as PARSERS  # vLLM's names; none: never split


@dataclass(frozen=True)
class ReasoningFormat:
    """Where thinking starts and ends: the tags' text and their (single) token ids.

    `opens`: the output starts in thinking even when the prompt does not end with the start
    tag (DeepSeek-R1's models may leave it out)."""

    name: str
    start: str
    end: str
    start_id: int
    end_id: int
    opens: bool = False

    def thinking_at_start(self, prompt_ids: Sequence[int]) -> bool | None:
        """True: the prompt left a thinking open; False: it closed one (Qwen3's template with
        enable_thinking false writes an empty one), so the model answers; None: the model
        may open one with its first token."""
        starts = _last(prompt_ids, self.start_id)
        ends = _last(prompt_ids, self.end_id)
        if starts > ends:
            return True
        if ends >= 0:
            return False
        return True if self.opens else None


def _last(ids: Sequence[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


def choose_format(tokenizer: Any, name: str | None = None) -> ReasoningFormat | None:
    """The model's reasoning format: `name` (vLLM's --reasoning-parser) when given, else found
    from the chat template (it writes `<think>` and `</think>`, each one token). ValueError
    when the named parser needs tags the vocabulary lacks."""
    if name == "none":
        return None
    name = name or None
    if name is not None and name not in PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}, not {name!r}")
    ids = _tag_ids(tokenizer, "<think>", "</think>")
    if name is None:
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or "</think>" not in template or ids is None:
            return None
        name = "qwen3"
    if ids is None:
        raise ValueError(
            f"--reasoning-parser {name}: the tokenizer has no single tokens for <think> and "
            "</think>"
        )
    return ReasoningFormat(name, "<think>", "</think>", *ids, opens=name == "deepseek_r1")


def _tag_ids(tokenizer: Any, start: str, end: str) -> tuple[int, int] | None:
    vocab: Mapping[str, int] = tokenizer.get_vocab()
    if start in vocab and end in vocab:
        return vocab[start], vocab[end]
    return None


class Splitter:
    """The released text cut into (reasoning, answer) pieces as it arrives.

    `thinking` True: the text starts inside the thinking; None: it may open with the start tag
    (whitespace before it is dropped); False: all is answer. A tag split across pieces is held
    back until it is known. A thinking never closed is all reasoning."""

    def __init__(self, start: str, end: str, thinking: bool | None) -> None:
        self._start = start
        self._end = end
        self._state = {True: "think", None: "before", False: "answer"}[thinking]
        self._held = ""

    @property
    def thinking(self) -> bool:
        return self._state == "think"

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) released by this piece of text."""
        reasoning: list[str] = []
        answer: list[str] = []
        text = self._held + text
        self._held = ""
        while text:
            if self._state == "answer":
                answer.append(text)
                break
            if self._state == "before":
                stripped = text.lstrip()
                if not stripped:
                    self._held = text
                    break
                if stripped.startswith(self._start):
                    self._state = "think"
                    text = stripped[len(self._start) :]
                    continue
                if self._start.startswith(stripped):
                    self._held = text  # perhaps the start tag, not all here yet
                    break
                self._state = "answer"
                continue
            cut = text.find(self._end)
            if cut >= 0:
                reasoning.append(text[:cut])
                self._state = "answer"
                text = text[cut + len(self._end) :]
                continue
            hold = _partial_suffix(text, self._end)
            reasoning.append(text[: len(text) - hold])
            self._held = text[len(text) - hold :]
            break
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """The text ends: what was held back, in the part it was in."""
        held, self._held = self._held, ""
        if self._state == "think":
            return held, ""
        if self._state == "before":
            return "", held.lstrip()
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that begins the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class Thinking:
    """One request's thinking, followed token by token on the step loop.

    `budget`: thinking tokens allowed (None: no limit); when spent, the next token is the
    end tag's, whatever was sampled. `pending`: the request's grammar matcher, held back until
    the thinking ends."""

    format: ReasoningFormat
    splitter: Splitter
    state: bool | None  # True: thinking; False: answering; None: the first token decides
    budget: int | None = None
    pending: Any = None
    spent: int = 0  # thinking tokens so far
    forced: int = 0  # end tags forced by the budget
    tags: int = 0  # start and end tags generated

    @property
    def tokens(self) -> int:
        """Generated tokens that belong to the thinking, its tags included."""
        return self.spent + self.tags

    def steer(self, token: int) -> int:
        """The token to keep: the end tag's once the budget is spent."""
        if self.state is True and self.budget is not None and self.spent >= self.budget:
            if token != self.format.end_id:
                self.forced += 1
            return self.format.end_id
        return token

    def observe(self, token: int) -> bool:
        """Follow one kept token; True when it ended the thinking (the grammar starts next)."""
        if self.state is None:
            self.state = token == self.format.start_id
            self.tags += self.state
            return False
        if self.state is True:
            if token == self.format.end_id:
                self.state = False
                self.tags += 1
                return True
            self.spent += 1
        return False


class OpenOrGrammar:
    """A grammar matcher that also allows the start tag as the first token: a model that may
    think opens its thinking there, and its grammar then waits for the answer."""

    def __init__(self, inner: Any, start_id: int) -> None:
        self.inner = inner
        self._start_id = start_id

    @property
    def vocab_size(self) -> int:
        return int(self.inner.vocab_size)

    def fill(self, bitmask: Any, index: int) -> None:
        self.inner.fill(bitmask, index)
        word, bit = divmod(self._start_id, 32)
        if word < bitmask.shape[1]:
            value = -(1 << 31) if bit == 31 else 1 << bit  # an int32's two's complement
            bitmask[index, word] = bitmask[index, word] | value

    def accept(self, token: int) -> bool:
        return True if token == self._start_id else bool(self.inner.accept(token))

    @property
    def finished(self) -> bool:
        return bool(self.inner.finished)
