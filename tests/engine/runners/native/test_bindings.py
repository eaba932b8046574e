"""The native decode attention kernel: against an fp32 reference, in the runner, kept in the
library cache, and without a compiler."""

from __future__ import annotations

import random
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from predictor import toolchain
from predictor.config import ModelSettings, Settings
from predictor.engine.runners.attention import NativeAttention, TorchAttention
from predictor.engine.runners.cpu import ModelRunner
from predictor.engine.runners.native import bindings as native
from predictor.engine.step import StepRow
from tests.engine.runners.test_cpu import step_logits
from tests.support import tune_cache

needs_compiler = pytest.mark.skipif(
    not any(shutil.which(cc) for cc in ("cc", "gcc", "g++", "clang")),
    reason="no C compiler on this machine: the torch path serves",
)


def reference(
    query: torch.Tensor, pool: torch.Tensor, tables: list[list[int]], lengths: list[int]
) -> torch.Tensor:
    """Plain fp32 attention of each row's query heads over its own positions."""
    heads, kv_heads, block = query.shape[1], pool.shape[0] // 2, 16
    group = heads // kv_heads
    out = []
    for row, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        slots = torch.tensor([table[p // block] * block + p % block for p in range(length)])
        kv = pool.float()[:, slots]  # [2 kvh, L, dim]
        q = query[row].float().view(kv_heads, group, -1)
        scores = q @ kv[:kv_heads].transpose(-1, -2) / q.shape[-1] ** 0.5  # [kvh, G, L]
        out.append((scores.softmax(-1) @ kv[kv_heads:]).reshape(heads * q.shape[-1]))
    return torch.stack(out)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 32), (8, 8, 16)])
def test_kernel_matches_fp32_attention_over_scattered_blocks(
    heads: int, kv_heads: int, dim: int, threads: int
) -> None:
    rng = random.Random(heads)
    kernel = native.decode_attention(dim, heads // kv_heads, 16)
    blocks = 64
    pool = torch.randn(2 * kv_heads, blocks * 16 + 1, dim).to(torch.bfloat16)
    lengths = [1, 15, 16, 17, 200, 33]  # block edges, one token, a long row
    free = list(range(blocks))
    rng.shuffle(free)  # each row's blocks scattered over the pool
    tables = [[free.pop() for _ in range((n + 15) // 16)] for n in lengths]
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    # the queries as the runner holds them: q heads then k and v in one row
    qkv = torch.randn(len(lengths), (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    out = torch.full((len(lengths), heads * dim), float("nan"), dtype=torch.bfloat16)
    scratch = torch.empty(native.ATTENTION_QUERIES * (heads // kv_heads) * max(lengths))
    row_lengths = torch.tensor(lengths)  # held: the kernel gets addresses only
    ones = torch.ones(len(lengths), dtype=torch.long)
    kernel(qkv, pool, padded, row_lengths, ones, len(lengths), dim**-0.5, out, scratch, threads)
    expected = reference(
        qkv[:, : heads * dim].view(len(lengths), heads, dim), pool, tables, lengths
    )
    assert torch.isfinite(out.float()).all()
    # bf16 output: within one rounding of values of magnitude <= ~4
    assert (out.float() - expected).abs().max() < 0.02


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_queries_in_one_pass_equal_each_decoded_alone(threads: int) -> None:
    """A row verifying drafts (or a prompt chunk attending token by token) passes its queries
    together, query t seeing one key more than t - 1; each output is bit for bit the one that
    query gets as a decode row of its own, however many queries share the pass (past
    ATTENTION_QUERIES: in several passes)."""
    heads, kv_heads, dim = 9, 3, 64
    kernel = native.decode_attention(dim, heads // kv_heads, 16)
    rng = random.Random(7)
    free = list(range(40))
    rng.shuffle(free)
    pool = torch.randn(2 * kv_heads, 40 * 16 + 1, dim).to(torch.bfloat16)
    # (keys the first query sees, queries): a decode row, drafts over a block edge, a long chunk
    spans = [(30, 1), (14, 5), (100, 20), (1, 3)]
    tables = [[free.pop() for _ in range((n + c + 14) // 16)] for n, c in spans]
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    queries = sum(c for _, c in spans)
    qkv = torch.randn(queries, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    longest = max(n + c - 1 for n, c in spans)
    scratch = torch.empty(native.ATTENTION_QUERIES * (heads // kv_heads) * longest)
    together = torch.full((queries, heads * dim), float("nan"), dtype=torch.bfloat16)
    lengths = torch.tensor([n for n, _ in spans])
    counts = torch.tensor([c for _, c in spans])
    kernel(qkv, pool, padded, lengths, counts, len(spans), dim**-0.5, together, scratch, threads)
    alone_tables = torch.cat([padded[r : r + 1].expand(c, -1) for r, (_, c) in enumerate(spans)])
    alone_lengths = torch.tensor([n + t for n, c in spans for t in range(c)])
    alone = torch.full_like(together, float("nan"))
    kernel(qkv, pool, alone_tables.contiguous(), alone_lengths, torch.ones(queries, dtype=torch.long),
           queries, dim**-0.5, alone, scratch, threads)  # fmt: skip
    assert torch.isfinite(together.float()).all()
    assert torch.equal(together, alone)


# a C parameter's type as PROTOTYPES shortens it
C_TYPES = {"int64_t": "i64", "float": "f32", "int": "int", "size_t": "size_t", "void": "void"}
EXPORTED = re.compile(r"^(void|int|int64_t|size_t) (\w+)\(([^)]*)\) \{", re.M)


def test_the_prototypes_table_is_what_each_source_exports() -> None:
    for source, table in native.PROTOTYPES.items():
        text = (Path(native.__file__).parent / source).read_text()
        exported = {}
        for result, name, params in EXPORTED.findall(text):
            args = []
            for param in params.replace("const ", "").split(","):
                if param.strip() in ("", "void"):
                    continue
                kind, arg = param.split()
                pointer = "*" in kind + arg
                args.append(("ptr" if pointer else C_TYPES[kind], arg.lstrip("*")))
            exported[name] = (C_TYPES[result], args)
        assert native.prototypes(table) == exported, source
    assert set(native.PROTOTYPES) == {path.name for path in native.HEADER.parent.glob("*.c")}


@needs_compiler
def test_runner_native_and_torch_attention_agree(tiny_gptq: Any) -> None:
    model = tiny_gptq.model
    fast = ModelRunner(
        model, torch.device("cpu"), 64, 16, attention="native", autotune_cache=tune_cache()
    )
    plain = ModelRunner(
        model, torch.device("cpu"), 64, 16, attention="torch", autotune_cache=tune_cache()
    )
    assert fast._native is not None and plain._native is None
    # the attention chosen once at start: the kernel's with the native ops, or torch's
    assert type(fast._attend) is NativeAttention and type(plain._attend) is TorchAttention
    rng = random.Random(9)
    # rows of different lengths: decode steps where the torch path masks and the kernel stops
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (3, 16, 17, 40)]
    a, b = step_logits(fast, prompts, 8), step_logits(plain, prompts, 8)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.argmax(dim=-1), y.argmax(dim=-1))
        # the torch path rounds scores and probabilities to bf16, the kernel keeps fp32: logits
        # of this random model reach ~50, where two bf16 steps are 0.5 (std ~5.7)
        assert torch.allclose(x, y, atol=0.1 * float(y.std()))


@needs_compiler
def test_runner_refuses_a_block_outside_the_cache(tiny_gptq: Any) -> None:
    runner = ModelRunner(
        tiny_gptq.model, torch.device("cpu"), 4, 16, attention="native", autotune_cache=tune_cache()
    )
    runner.forward([StepRow([0], 0, [5, 6, 7], True)])
    with pytest.raises(ValueError, match="outside the cache"):
        runner.forward([StepRow([0, 4], 16, [8], True)])  # block 4 of 0..3


@needs_compiler
def test_attention_and_layer_ops_are_kept_in_the_library_cache(
    tiny_gptq: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled at a first start into the library cache and loaded from it at the next: both
    were compiled afresh at every start of the server."""
    compiled: list[str] = []
    compile_ = toolchain._compile

    def counted(cc: str, source: Path, *args: Any) -> Any:
        compiled.append(source.name)
        return compile_(cc, source, *args)

    monkeypatch.setattr(toolchain, "_compile", counted)

    def start() -> None:
        native.decode_attention.cache_clear()  # as in a new process
        native.layer_ops.cache_clear()
        runner = ModelRunner(
            tiny_gptq.model, torch.device("cpu"), 4, 16, attention="native",
            autotune_cache=tmp_path,
        )  # fmt: skip
        assert runner._native is not None and runner._ops is not None

    try:
        start()
        assert sorted(compiled) == ["decode_attention.c", "layer_ops.c"]
        kept = native.library_cache(tmp_path).glob("*.so")
        assert sorted(path.name.split("-")[0] for path in kept) == ["decode_attention", "layer_ops"]
        start()
        assert len(compiled) == 2  # read back, not compiled again
    finally:
        native.decode_attention.cache_clear()
        native.layer_ops.cache_clear()


def test_without_a_compiler_auto_falls_back_and_native_refuses(
    tiny_gptq: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    native.decode_attention.cache_clear()
    try:
        with pytest.raises(native.NativeUnavailable, match="no C compiler"):
            native.decode_attention(32, 2, 16)
        runner = ModelRunner(tiny_gptq.model, torch.device("cpu"), 64, 16)  # auto
        assert runner._native is None
        logits = runner.forward([StepRow([0], 0, [5, 6, 7], True)])
        assert logits.shape[0] == 1 and torch.isfinite(logits).all()
        with pytest.raises(native.NativeUnavailable):
            ModelRunner(tiny_gptq.model, torch.device("cpu"), 64, 16, attention="native")
    finally:
        native.decode_attention.cache_clear()


def test_native_needs_a_bf16_model(tiny_dense: Any) -> None:
    with pytest.raises(ValueError, match="bf16"):
        ModelRunner(tiny_dense.model, torch.device("cpu"), 64, 16, attention="native")
    assert ModelRunner(tiny_dense.model, torch.device("cpu"), 64, 16)._native is None  # fp32


def test_attention_setting_is_validated() -> None:
    Settings(ModelSettings(attention="torch")).check()
    with pytest.raises(ValueError, match="--attention"):
        Settings(ModelSettings(attention="fast")).check()


def test_a_failing_compiler_or_temp_folder_is_unavailable_not_a_crash(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    native.decode_attention.cache_clear()
    try:
        monkeypatch.setenv("CC", "false")  # found, fails every compile
        with pytest.raises(native.NativeUnavailable, match="false failed"):
            native.decode_attention(32, 2, 16)
        monkeypatch.delenv("CC")
        monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "missing"))
        if any(shutil.which(cc) for cc in ("cc", "gcc", "g++", "clang")):
            with pytest.raises(native.NativeUnavailable, match="could not be built or loaded"):
                native.decode_attention(32, 2, 16)
    finally:
        native.decode_attention.cache_clear()


@needs_compiler
def test_layer_ops_split_rows_over_threads_with_the_same_numbers() -> None:
    ops = native.layer_ops(32)
    generator = torch.Generator().manual_seed(5)
    rows, dim, inner = 7, 96, 80
    weight = torch.randn(dim, generator=generator).bfloat16()
    delta = torch.randn((rows, dim), generator=generator).bfloat16()
    gate_up = torch.randn((rows, 2 * inner), generator=generator).bfloat16()
    results = []
    for threads in (1, 2):
        hidden = torch.ones((rows, dim), dtype=torch.bfloat16)
        normed = torch.empty_like(hidden)
        ops.add_rms_norm(hidden.data_ptr(), delta.data_ptr(), weight.data_ptr(), 1e-5,
                         normed.data_ptr(), rows, dim, threads)  # fmt: skip
        silu = torch.empty((rows, inner), dtype=torch.bfloat16)
        ops.silu_mul(gate_up.data_ptr(), rows, inner, silu.data_ptr(), threads)
        results.append((hidden, normed, silu))
    for one, two in zip(*results, strict=True):
        assert torch.equal(one, two)
    hidden, normed, silu = results[0]
    assert torch.equal(hidden, (1.0 + delta.float()).bfloat16())
    expected = torch.rms_norm(hidden.float(), (dim,), weight.float(), 1e-5)
    assert torch.allclose(normed.float(), expected, rtol=1e-2, atol=1e-2)
    gate, up = gate_up.float().split(inner, -1)
    assert torch.allclose(silu.float(), torch.nn.functional.silu(gate) * up, rtol=1e-2, atol=1e-2)


@needs_compiler
def test_the_matmuls_build_in_the_background_once(tmp_path: Any, monkeypatch: Any) -> None:
    """`python -m predictor` starts both builds before loading the checkpoint; the runner's own
    call, made while a build runs, waits for that build's library instead of starting another."""
    if not native.usable_isas():
        pytest.skip("no instruction set the native kernels are built for")
    monkeypatch.setattr(native, "_INT4", {})  # as in a new process
    monkeypatch.setattr(native, "_INT8", {})
    built: list[str] = []
    started = {name: threading.Event() for name in ("int4_matmul.c", "int8_matmul.c")}
    real = native._matmul_library

    def counted(isa: str, source: Path, cache_dir: Path | None) -> Any:
        built.append(source.name)
        started[source.name].set()  # under the lock of its kind
        return real(isa, source, cache_dir)

    monkeypatch.setattr(native, "_matmul_library", counted)
    cache = native.library_cache(tmp_path)
    threads = native.build_in_background(cache)
    assert [t.name for t in threads] == ["build-int4_matmul", "build-int8_matmul"]
    assert all(event.wait(30) for event in started.values())
    isa = native.usable_isas()[0]
    int4, int8 = native.int4_matmul(isa), native.int8_matmul(isa)  # no cache_dir: theirs serve
    for thread in threads:
        thread.join(120)
    assert sorted(built) == ["int4_matmul.c", "int8_matmul.c"]  # each built once
    assert native.int4_matmul(isa) is int4 and native.int8_matmul(isa) is int8
    assert sorted(p.name.split("-")[0] for p in cache.glob("*.so")) == [
        "int4_matmul",
        "int8_matmul",
    ]


@needs_compiler
def test_the_attention_kernels_build_in_the_background(tmp_path: Any, monkeypatch: Any) -> None:
    """Given the model's attention shape (read from config.json before the load), the layer ops
    and decode attention compile while the checkpoint loads: the runner's calls after find them
    in the library cache and compile nothing."""
    cache = native.library_cache(tmp_path)
    monkeypatch.setattr(native, "usable_isas", lambda flags=None: [])  # the matmuls not built
    for thread in native.build_in_background(cache, (64, 3, 16)):
        thread.join(180)
    assert sorted(p.name.split("-")[0] for p in cache.glob("*.so")) == [
        "decode_attention",
        "layer_ops",
    ]

    def no_compiler(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("compiled again")

    monkeypatch.setattr(toolchain, "_compile", no_compiler)
    native.layer_ops(64, cache)
    native.decode_attention(64, 3, 16, cache)
