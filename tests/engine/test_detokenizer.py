from collections.abc import Sequence

from transformers import AutoTokenizer

from predictor.engine.detokenizer import IncrementalDetokenizer, byte_table


class CharDecoder:
    """One token per character: makes hold-back behaviour easy to see."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def feed(detok: IncrementalDetokenizer, text: str) -> list[str]:
    pieces = [detok.push(ord(c)) for c in text]
    if not detok.stopped:
        pieces.append(detok.flush())
    return pieces


def test_stop_string_spanning_tokens_never_leaks() -> None:
    detok = IncrementalDetokenizer(CharDecoder(), [], ["END"])
    pieces = feed(detok, "abcENxENDzzz")
    assert "".join(pieces) == "abcENx"
    assert detok.stopped
    # "EN" was held back until "x" showed it was not the start of "END"
    assert pieces[3:6] == ["", "", "ENx"]


def test_text_is_released_at_the_end_when_no_stop_follows() -> None:
    detok = IncrementalDetokenizer(CharDecoder(), [], ["STOP"])
    assert "".join(feed(detok, "xxST")) == "xxST"
    assert not detok.stopped


def test_earliest_of_several_stops_wins() -> None:
    detok = IncrementalDetokenizer(CharDecoder(), [], ["bc", "abcd"])
    assert "".join(feed(detok, "zabcd")) == "za"
    assert detok.matched == "bc"  # the one that ended the text (Anthropic's stop_sequence)
    unmatched = IncrementalDetokenizer(CharDecoder(), [], ["STOP"])
    feed(unmatched, "xx")
    assert unmatched.matched is None


def test_real_tokenizer_multibyte_and_stop(tokenizer_dir) -> None:  # type: ignore[no-untyped-def]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "Crème brûlée 🙂 costs 5€.\n\nNext: 日本語"
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, [])
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)
    # several byte-level tokens form one emoji: some pushes release nothing
    assert any(p == "" for p in pieces[:-1])

    detok = IncrementalDetokenizer(tokenizer, prompt, ["\n\nNext"])
    pieces = [detok.push(i) for i in ids]
    assert detok.stopped
    assert "".join(pieces) == "Crème brûlée 🙂 costs 5€."


def test_byte_table_path_equals_decode_path(tokenizer_dir) -> None:  # type: ignore[no-untyped-def]
    import random

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    table = byte_table(tokenizer)
    assert table is not None  # SmolLM2's tokenizer is byte-level BPE
    rng = random.Random(3)
    text = "Crème brûlée 🙂 costs 5€.\n\nNext: 日本語 <|im_end|>"
    cases = [tokenizer.encode(text, add_special_tokens=False)]
    cases += [[rng.randrange(len(tokenizer)) for _ in range(40)] for _ in range(20)]
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    for ids in cases:
        slow = IncrementalDetokenizer(tokenizer, prompt, [])
        fast = IncrementalDetokenizer(tokenizer, prompt, [], table)
        slow_text = "".join(slow.push(i) for i in ids) + slow.flush()
        fast_text = "".join(fast.push(i) for i in ids) + fast.flush()
        assert fast_text == slow_text
    for stop in ("\n\nNext", "€"):
        fast = IncrementalDetokenizer(tokenizer, prompt, [stop], table)
        pieces = [fast.push(i) for i in cases[0]]
        assert fast.stopped and "".join(pieces) == text[: text.find(stop)]


def test_byte_table_refuses_tokenizers_of_other_kinds() -> None:
    assert byte_table(CharDecoder()) is None


def test_a_kept_special_token_stays_in_the_text_on_both_paths(tokenizer_dir) -> None:  # type: ignore[no-untyped-def]
    """Mistral's [TOOL_CALLS] is a special token in its tokenizer: skipped, the calls after it
    read as content. Kept (a request with tools), its text is there, on the byte table's path
    and on decode's, and the text after it keeps its spaces; other special tokens still go."""
    from predictor.engine.tool_formats import get
    from predictor.engine.tool_formats.base import split_with

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    marker = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    text = ' Sure.[TOOL_CALLS][{"name": "convert", "arguments": {"amount": 3}}]'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert marker in ids
    ids.append(tokenizer.eos_token_id)  # a special token not kept
    for table in (byte_table(tokenizer), None):
        assert table is None or table[marker] == b""
        skipped = IncrementalDetokenizer(tokenizer, [], [], table)
        assert "".join(feed_ids(skipped, ids)) == text.replace("[TOOL_CALLS]", "")
        kept = IncrementalDetokenizer(tokenizer, [], [], table, {marker: "[TOOL_CALLS]"})
        out = "".join(feed_ids(kept, ids))
        assert out == text, (table is None, out)
        content, calls = split_with(get("mistral").parser(), out)
        assert content == " Sure." and [c.name for c in calls] == ["convert"]


def feed_ids(detok: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]
