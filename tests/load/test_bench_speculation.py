"""load/bench_speculation.py without servers: every kind's prompts load, the report's table has
one cell per column with and without llama.cpp beside us, and rounds report their median."""

from __future__ import annotations

import argparse

import pytest

from load.bench_speculation import KINDS, Level, Server, conversations, report


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_has_prompts(kind: str) -> None:
    convs = conversations(kind)
    assert len(convs) >= 3
    assert all(c[0]["role"] == "user" and c[0]["content"] for c in convs)


@pytest.mark.parametrize("peers", [0, 2])
def test_the_table_has_a_cell_per_column(peers: int) -> None:
    servers = [Server(name, None) for name in ["off", "on", *(f"llama {i}" for i in range(peers))]]
    for server, speed in zip(servers, [10.0, 20.0, 5.0, 8.0], strict=False):
        server.results[("chat", 16)] = Level(speed, ["a", "b"], 4, 3)
    servers[1].results[("chat", 16)].texts = ["a", "c"]
    args = argparse.Namespace(threads=1, max_tokens=16, kinds=["chat"], concurrency=[16])
    header, rule, row = report(servers, args)[2:]
    assert header.count("|") == rule.count("|") == row.count("|")
    assert "| 2.00x | 0.75 | 1/2 |" in row
    assert row.endswith("| 5.0 | 8.0 | 2.50x |" if peers else "| 1/2 |")


def test_rounds_report_the_median_ratio_and_its_range() -> None:
    off, on = Server("off", None), Server("on", None)
    for server, speeds in ((off, [10.0, 12.0, 8.0]), (on, [20.0, 30.0, 12.0])):
        for speed in speeds:
            level = Level(speed, ["a"], 4, 3)
            server.results.setdefault(("chat", 1), level)
            server.rounds.setdefault(("chat", 1), []).append(level)
    args = argparse.Namespace(threads=1, max_tokens=16, kinds=["chat"], concurrency=[1])
    lines = report([off, on], args)
    assert "median of 3 rounds" in lines[0]
    # ratios 2.00, 2.50, 1.50; speeds are each server's median
    assert lines[-1] == "| chat | 1 | 10.0 | 20.0 | 2.00x (1.50-2.50) | 0.75 | 1/1 |"
