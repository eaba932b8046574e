"""The runner on the tiny GPTQ model: fused int4 projections, paged attention, vs transformers."""

from __future__ import annotations

import random
from typing import Any

import torch

from predictor.engine.runners.cpu import ModelRunner
from predictor.engine.step import StepRow
from tests.support import tune_cache


def step_logits(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Prefill every prompt in one step, then decode greedily; logits of every step."""
    block = runner.block_size
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    out = [runner.forward([StepRow(t, 0, p, True) for t, p in zip(tables, prompts, strict=True)])]
    lengths = [len(p) for p in prompts]
    for _ in range(steps):
        last = out[-1].argmax(dim=-1).tolist()
        rows = [StepRow(t, n, [tok], True) for t, n, tok in zip(tables, lengths, last, strict=True)]
        assert all(n + 1 <= len(t) * block for t, n in zip(tables, lengths, strict=True))
        out.append(runner.forward(rows))
        lengths = [n + 1 for n in lengths]
    return out


def test_fused_int4_projections_give_the_same_tokens(tiny_gptq: Any) -> None:
    model = tiny_gptq.model
    # torch's int4 op in the fused layers: the autotune's pick can be int8 activations (under
    # load, or with one thread), held to its own bar in test_every_kernel_gives_the_reference_...
    fused = ModelRunner(
        model, torch.device("cpu"), 64, 16, kernel="int4_op", autotune_cache=tune_cache()
    )
    assert all(layer is not None for layer in fused._fused)  # every layer fused on this CPU
    plain = ModelRunner(model, torch.device("cpu"), 64, 16, autotune_cache=tune_cache())
    plain._fused = [None] * len(plain._fused)  # the model's own gptqmodel modules
    rng = random.Random(4)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 17, 30)]
    a, b = step_logits(fused, prompts, 6), step_logits(plain, prompts, 6)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.argmax(dim=-1), y.argmax(dim=-1))
        assert torch.allclose(x, y, atol=0.05 * float(y.std()))


def test_paged_attention_matches_transformers_forward(tiny_gptq: Any) -> None:
    model = tiny_gptq.model
    # torch's int4 op, not the autotune's pick: the pick depends on timings (int8 activations
    # and head under load), and every pick is held to this reference in the test below
    runner = ModelRunner(
        model, torch.device("cpu"), 64, 16, kernel="int4_op", autotune_cache=tune_cache()
    )
    rng = random.Random(5)
    prompt = [rng.randrange(100, 40000) for _ in range(23)]  # distinct tokens
    ours = step_logits(runner, [prompt], 4)
    ids = prompt + [int(x.argmax()) for x in ours[:-1]]
    with torch.inference_mode():
        theirs = model(torch.tensor([ids])).logits[0, len(prompt) - 1 :].float()
    for i, x in enumerate(ours):
        assert int(x[0].argmax()) == int(theirs[i].argmax())
        assert torch.allclose(x[0], theirs[i], atol=0.05 * float(theirs[i].std()))


def fused_kernels() -> list[str]:
    from predictor.engine.runners.kernels.int4_linear import prepack_available
    from predictor.engine.runners.native import bindings as native

    names = ["auto", "int4_op"] + (["prepacked_bf16"] if prepack_available() else [])
    for isa in native.usable_isas():  # every instruction set this CPU runs, AVX2 included
        names += [f"native_f32_{isa}", f"native_i8_{isa}"]
    return names


def test_every_kernel_gives_the_reference_greedy_tokens(tiny_gptq: Any) -> None:
    """The reference path: torch's int4 op and torch's ops for attention, norms and rotary."""
    model = tiny_gptq.model
    reference = ModelRunner(
        model,
        torch.device("cpu"),
        64,
        16,
        attention="torch",
        kernel="int4_op",
        autotune_cache=tune_cache(),
    )
    rng = random.Random(8)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (3, 21, 40)]
    expected = step_logits(reference, prompts, 8)
    for kernel in fused_kernels():
        runner = ModelRunner(
            model, torch.device("cpu"), 64, 16, kernel=kernel, autotune_cache=tune_cache()
        )
        assert runner._ops is not None  # native attention and layer ops on this CPU
        got = step_logits(runner, prompts, 8)
        for x, y in zip(got, expected, strict=True):
            assert torch.equal(x.argmax(dim=-1), y.argmax(dim=-1)), kernel
            assert torch.allclose(x, y, atol=0.08 * float(y.std())), kernel


def test_a_kernel_that_cannot_run_is_refused_at_start(
    tiny_gptq: Any, tiny_dense: Any, monkeypatch: Any
) -> None:
    import pytest

    from predictor.engine.runners.native import bindings as native

    with pytest.raises(ValueError, match="kernel must be auto or one of"):
        ModelRunner(tiny_gptq.model, torch.device("cpu"), 64, 16, kernel="fastest")
    with pytest.raises(ValueError, match="needs fused int4 layers"):
        ModelRunner(tiny_dense.model, torch.device("cpu"), 64, 16, kernel="native_f32")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(native, "_INT4", {})
    with pytest.raises(ValueError, match="unavailable"):
        ModelRunner(tiny_gptq.model, torch.device("cpu"), 64, 16, kernel="native_i8")
    # auto without a compiler: torch's kernels only, the same tokens
    runner = ModelRunner(tiny_gptq.model, torch.device("cpu"), 64, 16, attention="torch")
    logits = runner.forward([StepRow([0], 0, [5, 6, 7], True)])
    assert runner.choices is not None
    kernels = {k for plan in runner.choices.plans.values() for _, k in plan}
    assert not any(k.startswith("native_") for k in kernels)
    assert torch.isfinite(logits).all()


def test_the_native_matmuls_are_built_into_the_autotune_cache_once(
    tiny_gptq: Any, tmp_path: Any, monkeypatch: Any
) -> None:
    """Both the int4 projections' and the int8 head's libraries: the head's was compiled afresh
    at every start (about a second before the server was ready)."""
    import pytest

    from predictor.engine.runners.native import bindings as native

    if not native.usable_isas():
        pytest.skip("no instruction set the native kernels are built for")

    def bound() -> dict[str, int]:
        monkeypatch.setattr(native, "_INT4", {})  # as in a new process
        monkeypatch.setattr(native, "_INT8", {})
        runner = ModelRunner(
            tiny_gptq.model, torch.device("cpu"), 64, 16, attention="torch",
            autotune_cache=tmp_path,
        )  # fmt: skip
        runner.bind_thread()
        return {p.name: p.stat().st_mtime_ns for p in (tmp_path / "native").glob("*.so")}

    first = bound()
    assert sorted(name.split("-")[0] for name in first) == ["int4_matmul", "int8_matmul"]
    assert bound() == first  # loaded from the cache, not built again
