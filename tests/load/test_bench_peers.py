"""load/bench_peers.py without vLLM: its table, the RESULTS.md section it replaces, the memory of
a process tree, and a real run against our server on the tiny model (`--servers ours`)."""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

from load.bench_peers import (
    SECTION,
    SHARED_SECTION,
    Measured,
    Memory,
    format_section,
    format_shared_section,
    format_table,
    kernel_choices,
    process_tree,
    replace_section,
    rounds_for,
    tree_memory,
)
from load.peer_shapes import kv_bytes_per_token
from tests.support import REPO


def _row(tok_s: float, ttft: float = 0.2, itl50: float = 0.04, itl95: float = 0.06) -> dict:
    return {"tok_s": tok_s, "ttft_p50": ttft, "itl_p50": itl50, "itl_p95": itl95}


def test_table_has_one_row_per_level_with_the_ratios() -> None:
    vllm = Measured("vLLM-CPU", {1: _row(40.0), 16: _row(360.0, ttft=0.226)})
    llama = Measured("llama.cpp", {1: _row(60.0), 16: _row(90.0)})
    ours = Measured("ours", {1: _row(30.0), 16: _row(180.0, itl95=0.1)})
    lines = format_table([vllm, llama, ours], [1, 16])
    assert len(lines) == 4
    assert lines[0].startswith("| C | vLLM-CPU tok/s | llama.cpp tok/s | ours tok/s | ours / vLLM")
    assert lines[2].startswith("| 1 | 40.0 | 60.0 | 30.0 | 0.75x | 0.50x |")
    assert lines[3] == (
        "| 16 | 360.0 | 90.0 | 180.0 | 0.50x | 2.00x | 226 / 200 / 200 | 40 / 40 / 40 "
        "| 60 / 60 / 100 |"
    )


def test_table_marks_a_server_that_did_not_run() -> None:
    lines = format_table([Measured("llama.cpp"), Measured("ours", {4: _row(90.0)})], [4])
    assert lines[2] == "| 4 | - | 90.0 | - | - / 200 | - / 40 | - / 60 |"


def test_section_states_date_cpu_threads_prefill_memory_and_choices() -> None:
    args = argparse.Namespace(
        threads=1, max_seqs=32, max_tokens=64, cpus=2, concurrency=[16], memory_at=16,
        fp_dir=Path("fp"), gptq_dir=Path("gptq"), vllm_kv_cache_gib=1, rounds=2,
        min_requests=8, load_average=(1.0, 2.0, 3.0), llama_ctx=32768, baseline_tree=Path("m"),
        shape=None,
    )  # fmt: skip
    prefill = {"prompt_tokens": 1500, "seconds": 1.5, "tok_s": 1000.0}
    llama = Measured("llama.cpp", {16: _row(90.0)}, prefill=dict(prefill, tok_s=250.0))
    ours = Measured("ours", {16: _row(150.0)}, Memory(800.0, 700.0, 1), load=(1.5, 2.25),
                    prefill=prefill, choices=["kernel (measured) o 576x576/32 x30: 1+ rows x"])  # fmt: skip
    section = format_section([llama, ours], args, datetime.date(2026, 11, 29), pp512=137.0)
    assert section.startswith(SECTION + "\n")
    flat = " ".join(section.split())
    assert "2026-11-29" in section and "**1 compute thread**" in section
    assert "CPU: " in section and "--threads 1" in section and "-np C" in flat
    assert "load average 1.0/2.0/3.0" in section
    assert "while measuring: ours 1.5 to 2.2." in section
    assert "ours 800 MiB RSS (700 MiB PSS, 1 processes)" in flat
    assert "ours 1000 tok/s (1500 tokens in 1500 ms)" in flat and "pp512 137 tok/s" in flat
    assert "    kernel (measured) o 576x576/32 x30: 1+ rows x" in section
    prose = [line for line in section.splitlines() if not line.startswith(("|", "    "))]
    assert max(len(line) for line in prose) <= 100


def test_kernel_choices_are_read_from_a_server_log() -> None:
    log = (
        "2026 INFO predictor.engine.runners.kernels.autotune: kernels for CPU X, 1 threads, torch 2; flags: avx2\n"
        "noise\n2026 INFO predictor.engine.runners.kernels.autotune: kernel (measured) o 8x8/32 x1: 1+ rows a\n"
    )
    assert kernel_choices(log) == [
        "kernels for CPU X, 1 threads, torch 2; flags: avx2",
        "kernel (measured) o 8x8/32 x1: 1+ rows a",
    ]


def test_replace_section_appends_then_replaces_in_place() -> None:
    text = "# Results\n\n## Engine\n\nfast\n"
    first = replace_section(text, SECTION, f"{SECTION}\n\nrun 1\n")
    assert first == f"# Results\n\n## Engine\n\nfast\n\n{SECTION}\n\nrun 1\n"
    middle = first + "\n## Later\n\nkept\n"
    second = replace_section(middle, SECTION, f"{SECTION}\n\nrun 2\n")
    assert second == f"# Results\n\n## Engine\n\nfast\n\n{SECTION}\n\nrun 2\n\n## Later\n\nkept\n"
    assert replace_section(second, SECTION, f"{SECTION}\n\nrun 2\n") == second


def test_rounds_reach_the_minimum_requests() -> None:
    assert [rounds_for(c, 2, 8) for c in (1, 4, 16, 32)] == [8, 2, 2, 2]


def test_process_tree_memory_counts_children() -> None:
    script = "import time; print('up', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        assert child.pid in process_tree(os.getpid())
        alone, tree = tree_memory(child.pid), tree_memory(os.getpid())
        assert alone.processes == 1 and alone.rss_mib > 1 and alone.pss_mib > 0
        assert tree.processes >= 2 and tree.rss_mib > alone.rss_mib
    finally:
        child.kill()
        child.wait()


def test_bench_peers_measures_our_server(tiny_gptq_dir: Path, tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# Measured figures\n\n## Engine\n\nunchanged\n")
    command = [
        sys.executable, "-m", "load.bench_peers", "--servers", "ours", "--gptq-dir",
        str(tiny_gptq_dir), "--concurrency", "1", "2", "--memory-at", "2", "--rounds", "1",
        "--min-requests", "1", "--max-tokens", "4", "--results", str(results), "--no-prefill",
        "--log-dir", str(tmp_path), "--ready-timeout", "120",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    text = results.read_text()
    assert text.startswith("# Measured figures\n\n## Engine\n\nunchanged\n\n" + SECTION)
    rows = [line.split("|") for line in text.splitlines() if line.startswith(("| 1 ", "| 2 "))]
    assert [row[1].strip() for row in rows] == ["1", "2"]
    assert all(float(row[2]) > 0 for row in rows)  # ours alone
    assert "expected" not in text  # every request gave exactly --max-tokens tokens
    memory = " ".join(text.split()).split("whole process tree: ours ")[1]
    assert float(memory.split(" MiB RSS")[0]) > 50
    assert "Kernels chosen at start (ours):" in text and "kernel (" in text


def test_shared_prefix_section_has_hit_rates_and_ratios() -> None:
    args = argparse.Namespace(
        threads=1, max_tokens=32, cpus=2, concurrency=[1, 8], min_requests=8,
        load_average=(1.0, 2.0, 3.0),
    )  # fmt: skip

    def shared(tok_s: float, ttft: float, hit: float | None) -> dict:
        return {**_row(tok_s, ttft=ttft), "ttft_p95": ttft, "hit_rate": hit}

    ours = Measured("ours", {1: shared(40.0, 0.15, 0.99), 8: shared(100.0, 0.6, 0.98)})
    off = Measured("ours-nocache", {1: shared(8.0, 3.0, 0.0), 8: shared(8.0, 19.0, None)})
    section = format_shared_section([ours, off], args, datetime.date(2026, 12, 1))
    assert section.startswith(SHARED_SECTION + "\n")
    assert "| ours | 1 | 150 | 150 | 40.0 | 99% |" in section
    assert "| ours-nocache | 8 | 19000 | 19000 | 8.0 | - |" in section
    assert "C=1: ours / ours-nocache TTFT p50 0.05x, tokens/s 5.00x" in section
    assert "C=8: ours / ours-nocache TTFT p50 0.03x, tokens/s 12.50x" in section


def test_a_shape_section_has_a_column_per_gguf_and_the_kv_cache() -> None:
    """`--shape`: its own section, llama.cpp's Q4_0 and Q4_1 columns beside ours, both sides'
    KV cache the same tokens, sized for the shape (SmolLM2-1.7B: 24 layers x 32 kv heads x 64
    x keys and values x 2 bytes = 192 KiB a token)."""
    args = argparse.Namespace(
        threads=1, max_seqs=32, max_tokens=64, cpus=2, concurrency=[1, 8], memory_at=8,
        fp_dir=Path("fp"), gptq_dir=Path("models/shapes/smollm2-1.7b/gptq"), vllm_kv_cache_gib=1,
        rounds=2, min_requests=8, load_average=(1.0, 2.0, 3.0), llama_ctx=4096,
        baseline_tree=None, shape="smollm2-1.7b",
    )  # fmt: skip
    q4_0 = Measured("llama.cpp Q4_0", {1: _row(15.0), 8: _row(22.0)})
    q4_1 = Measured("llama.cpp Q4_1", {1: _row(14.0), 8: _row(21.0)})
    ours = Measured("ours", {1: _row(18.0), 8: _row(40.0)})
    section = format_section([q4_0, q4_1, ours], args, datetime.date(2026, 12, 5))
    assert section.startswith("## Side by side at the smollm2-1.7b shape\n")
    flat = " ".join(section.split())
    assert "ours / llama.cpp Q4_0" in section and "ours / llama.cpp Q4_1" in section
    assert "| 8 | 22.0 | 21.0 | 40.0 | 1.82x | 1.90x |" in section
    assert "4096 tokens of 192 KiB (768 MiB; ours `--max-cache-tokens 4096`)" in flat
    assert kv_bytes_per_token("smollm2-1.7b") == 192 * 1024


def test_the_threads_workload_measures_our_server_in_turns(
    tiny_gptq_dir: Path, tmp_path: Path
) -> None:
    """`--workload threads --servers ours`: two of our servers (1 and 2 threads) up at once,
    measured in turns, and each round's T2/T1 in the section."""
    results = tmp_path / "RESULTS.md"
    command = [
        sys.executable, "-m", "load.bench_peers", "--workload", "threads", "--servers", "ours",
        "--gptq-dir", str(tiny_gptq_dir), "--rounds", "2", "--min-requests", "1",
        "--max-tokens", "4", "--results", str(results), "--log-dir", str(tmp_path),
        "--ready-timeout", "120", "--speculative-off",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    text = results.read_text()
    assert "## Threads side by side" in text
    assert "our speculation off" in text
    row = next(line for line in text.splitlines() if line.startswith("| ours |"))
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert float(cells[1]) > 0 and float(cells[2]) > 0  # T=1 and T=2 tok/s
    assert cells[5].count(",") == 1  # two rounds, two paired ratios


def test_in_turns_workloads_default_their_levels() -> None:
    from load.bench_peers import parse_args

    assert parse_args(["--workload", "ttft"]).concurrency == [1, 16]
    threads = parse_args(["--workload", "threads", "--shape", "smollm2-1.7b"])
    assert threads.thread_counts == [1, 2] and threads.llama_ctx == 4096
