"""The reasoning split (engine/reasoning.py): the text state machine whole and streamed (split at
every position), the token-side thinking with its budget, and the format found from a tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from predictor.engine.reasoning import (
    OpenOrGrammar,
    ReasoningFormat,
    Splitter,
    Thinking,
    choose_format,
)

START, END = "<think>", "</think>"
# (text, thinking at start, reasoning, answer)
CASES = [
    ("<think>\nweigh it\n</think>\n\nThe answer.", None, "\nweigh it\n", "\n\nThe answer."),
    ("\n<think>a</think>b", None, "a", "b"),
    ("plain answer, no think", None, "", "plain answer, no think"),
    ("<thin is not the tag", None, "", "<thin is not the tag"),
    ("<think>never closed </thi", None, "never closed </thi", ""),
    ("already thinking</think>answer", True, "already thinking", "answer"),
    ("no end, all reasoning", True, "no end, all reasoning", ""),
    ("<think>x</think>y", False, "", "<think>x</think>y"),
    ("a </think> b </think> c", True, "a ", " b </think> c"),
    ("<think></think>", None, "", ""),
    ("  ", None, "", ""),
    ("", None, "", ""),
]


def whole(text: str, thinking: bool | None) -> tuple[str, str]:
    splitter = Splitter(START, END, thinking)
    reasoning, answer = splitter.feed(text)
    held_reasoning, held_answer = splitter.flush()
    return reasoning + held_reasoning, answer + held_answer


@pytest.mark.parametrize(("text", "thinking", "reasoning", "answer"), CASES)
def test_the_whole_text_splits(
    text: str, thinking: bool | None, reasoning: str, answer: str
) -> None:
    assert whole(text, thinking) == (reasoning, answer)


@pytest.mark.parametrize(("text", "thinking", "reasoning", "answer"), CASES)
def test_streamed_in_two_pieces_at_every_position_splits_the_same(
    text: str, thinking: bool | None, reasoning: str, answer: str
) -> None:
    for cut in range(len(text) + 1):
        splitter = Splitter(START, END, thinking)
        parts = [splitter.feed(text[:cut]), splitter.feed(text[cut:]), splitter.flush()]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == (reasoning, answer)


@pytest.mark.parametrize(("text", "thinking", "reasoning", "answer"), CASES)
def test_streamed_a_character_at_a_time_splits_the_same(
    text: str, thinking: bool | None, reasoning: str, answer: str
) -> None:
    splitter = Splitter(START, END, thinking)
    parts = [splitter.feed(c) for c in text] + [splitter.flush()]
    assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == (reasoning, answer)


def test_a_partial_end_tag_is_held_until_known() -> None:
    splitter = Splitter(START, END, True)
    assert splitter.feed("step one </th") == ("step one ", "")
    assert splitter.feed("ink>done") == ("", "done")


FORMAT = ReasoningFormat("qwen3", START, END, start_id=7, end_id=8)


def test_the_prompt_says_where_thinking_starts() -> None:
    assert FORMAT.thinking_at_start([1, 2, 7]) is True  # the template opened it
    assert FORMAT.thinking_at_start([1, 7, 8, 3]) is False  # enable_thinking false: closed
    assert FORMAT.thinking_at_start([1, 2, 3]) is None  # the model may open one
    opens = ReasoningFormat("deepseek_r1", START, END, 7, 8, opens=True)
    assert opens.thinking_at_start([1, 2, 3]) is True


def test_the_budget_forces_the_end_tag() -> None:
    thinking = Thinking(FORMAT, Splitter(START, END, None), None, budget=2)
    kept = []
    for sampled in [7, 5, 5, 5, 5, 5]:
        token = thinking.steer(sampled)
        thinking.observe(token)
        kept.append(token)
    assert kept == [7, 5, 5, 8, 5, 5] and thinking.forced == 1 and thinking.state is False


def test_no_budget_never_forces() -> None:
    thinking = Thinking(FORMAT, Splitter(START, END, True), True)
    assert [thinking.steer(5) for _ in range(100)] == [5] * 100


class _Grammar:
    vocab_size = 64

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def fill(self, bitmask: Any, index: int) -> None:
        bitmask[index][0] = 1 << 3  # token 3 only

    def accept(self, token: int) -> bool:
        self.accepted.append(token)
        return token == 3

    @property
    def finished(self) -> bool:
        return False


def test_a_grammar_that_may_first_see_the_start_tag_allows_it() -> None:
    inner = _Grammar()
    matcher = OpenOrGrammar(inner, start_id=7)

    class Mask:
        shape = (1, 2)

        def __init__(self) -> None:
            self.rows = [[0, 0]]

        def __getitem__(self, key: Any) -> Any:
            if isinstance(key, tuple):
                return self.rows[key[0]][key[1]]
            return self.rows[key]

        def __setitem__(self, key: tuple[int, int], value: int) -> None:
            self.rows[key[0]][key[1]] = value

    mask = Mask()
    matcher.fill(mask, 0)
    assert mask.rows[0][0] == (1 << 3) | (1 << 7)
    assert matcher.accept(7) and inner.accepted == []  # the tag is not the grammar's
    assert matcher.accept(3) and inner.accepted == [3]


class _Tokenizer:
    def __init__(self, vocab: dict[str, int], template: str | None) -> None:
        self._vocab = vocab
        self.chat_template = template

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


def test_the_format_is_found_from_the_template_and_vocabulary() -> None:
    tags = {"<think>": 5, "</think>": 6}
    found = choose_format(_Tokenizer(tags, "...<think>\n\n</think>..."))
    assert found is not None and (found.name, found.start_id, found.end_id) == ("qwen3", 5, 6)
    assert choose_format(_Tokenizer(tags, "no tags")) is None  # a template without thinking
    assert choose_format(_Tokenizer({}, "</think>")) is None  # tags that are not tokens
    assert choose_format(_Tokenizer(tags, "</think>"), "none") is None
    forced = choose_format(_Tokenizer(tags, None), "deepseek_r1")
    assert forced is not None and forced.opens
    with pytest.raises(ValueError, match="no single tokens"):
        choose_format(_Tokenizer({}, None), "qwen3")
    with pytest.raises(ValueError, match="must be one of"):
        choose_format(_Tokenizer(tags, None), "granite")
