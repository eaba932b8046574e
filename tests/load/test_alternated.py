"""load/alternated.py: the turns' order, the paired ratios, the gaps split by arrivals, and the
tables bench_peers' threads and ttft workloads print."""

from __future__ import annotations

import pytest

from load.alternated import Turns, arrivals_table, order, split_gaps, threads_table, ttft_table


def _row(tok_s: float, ttft: float = 0.5, itl50: float = 0.1, itl95: float = 0.2) -> dict:
    return {"tok_s": tok_s, "ttft_p50": ttft, "itl_p50": itl50, "itl_p95": itl95}


def test_turns_reverse_each_round() -> None:
    assert order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert order(["a", "b", "c"], 2) == ["a", "b", "c"]


def test_ratios_are_paired_by_round_and_the_median_is_of_the_pairs() -> None:
    # a slow machine in round 2 moves both sides: the paired ratio stays 2
    turns = Turns(1, {"x T=1": [_row(5), _row(2), _row(5)], "x T=2": [_row(10), _row(4), _row(9)]})
    assert turns.ratios("x T=2", "x T=1", "tok_s") == [2.0, 2.0, 1.8]
    lines = threads_table(turns, ["x"], [1, 2])
    assert lines[0].startswith("| side | T=1 tok/s | T=2 tok/s |")
    assert lines[2] == "| x | 5.00 | 9.00 | 100 | 100 | 2.00x (2.00, 2.00, 1.80) |"


def test_ttft_table_gives_each_server_over_the_peer() -> None:
    turns = Turns(16, {"llama.cpp": [_row(70, ttft=1.0)], "ours": [_row(200, ttft=0.6)]})
    lines = ttft_table([turns], ["llama.cpp", "ours"], "llama.cpp")
    assert lines[2] == "| 16 | llama.cpp | 1000 | 100 | 200 | 70.0 | - |"
    assert lines[3] == "| 16 | ours | 600 | 100 | 200 | 200.0 | 0.60x (0.60) |"


def test_gaps_overlapping_a_prefill_window_count_as_arrivals() -> None:
    stream = (0.0, [1.0, 1.1, 1.5, 1.6, 2.0])  # gaps 0.1, 0.4, 0.1, 0.4
    during, quiet = split_gaps([stream], [(1.2, 1.4), (1.9, 1.95)])
    assert during == pytest.approx([0.4, 0.4])
    assert quiet == pytest.approx([0.1, 0.1])


def test_arrivals_table_has_quiet_and_prefilling_medians() -> None:
    row = {"itl_p50_quiet": 0.02, "itl_p50_arrivals": 0.05, "itl_p95_quiet": 0.03,
           "itl_p95_arrivals": 0.2, "gaps": (10, 30), "ttft_p50_arrivals": 0.3}  # fmt: skip
    lines = arrivals_table({"ours": [row]})
    assert lines[2] == "| ours | 20 / 50 | 30 / 200 | 30 / 10 | 300 |"
