"""LoRA adapters in the runner: rows of two adapters and of the base model in one forward pass,
each with the logits of the model with its own adapter applied (transformers' forward with the
low-rank deltas hooked onto each adapted projection), prefill and decode alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from load.random_lora import write_adapter
from predictor.engine.runners.lora.weights import projection_shapes
from predictor.engine.step import StepRow
from predictor.model.lora import Adapter, load_adapter
from tests.engine.conftest import Tiny

MODULE_OWNER = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


def load(folder: Path, model: Any) -> Adapter:
    shapes = projection_shapes(model.model.layers[0])
    return load_adapter(folder.name, folder, shapes, len(model.model.layers), max_rank=64)


def reference_logits(model: Any, ids: list[int], adapter: Adapter | None) -> torch.Tensor:
    """transformers' forward, each adapted projection's output plus scale * B (A x)."""
    hooks = []
    if adapter is not None:
        for (layer, name), (a, b) in adapter.factors.items():
            module = getattr(getattr(model.model.layers[layer], MODULE_OWNER[name]), name)

            def add(_: Any, inputs: Any, out: torch.Tensor, a: Any = a, b: Any = b) -> Any:
                return out + adapter.scale * (inputs[0] @ a.T) @ b.T

            hooks.append(module.register_forward_hook(add))
    try:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float()
    finally:
        for hook in hooks:
            hook.remove()


@pytest.fixture(scope="module")
def adapters(
    tiny_dense: Tiny, tiny_dense_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[Adapter]:
    root = tmp_path_factory.mktemp("adapters")
    model = tiny_dense.model
    attention = write_adapter(root / "attention", tiny_dense_dir, 8, 1,
                              ["q_proj", "v_proj", "o_proj"], std=0.2)  # fmt: skip
    everything = write_adapter(root / "everything", tiny_dense_dir, 4, 2, std=0.2)
    return [load(attention, model), load(everything, model)]


def test_adapted_rows_batched_with_the_base_model_get_their_own_logits(
    tiny_dense: Tiny, adapters: list[Adapter]
) -> None:
    runner = tiny_dense.runner()
    for slot, adapter in enumerate(adapters, start=1):
        runner.add_adapter(slot, adapter.factors, adapter.scale)
    prompts = [[5, 17, 29, 41, 53, 65, 77], [9, 8, 7, 6, 5, 4, 3, 2, 1, 60], [100, 3, 200, 4]]
    slots = [0, 1, 2]  # the base model, then each adapter
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(3)]
    rows = [StepRow(t, 0, p, True, all_logits=True, adapter=s)
            for t, p, s in zip(tables, prompts, slots, strict=True)]  # fmt: skip
    logits = runner.forward(rows)
    references = [reference_logits(tiny_dense.model, p, [None, *adapters][s])
                  for p, s in zip(prompts, slots, strict=True)]  # fmt: skip
    base = reference_logits(tiny_dense.model, prompts[1], None)
    assert (references[1] - base).abs().max() > 0.1  # the adapter changes the model
    first = 0
    for prompt, reference in zip(prompts, references, strict=True):
        torch.testing.assert_close(logits[first : first + len(prompt)], reference,
                                   atol=2e-4, rtol=1e-4)  # fmt: skip
        first += len(prompt)
    # a decode step of all three: each row's next position, with its adapter
    nexts = [int(reference[-1].argmax()) for reference in references]
    decode = [StepRow(t, len(p), [n], True, adapter=s)
              for t, p, n, s in zip(tables, prompts, nexts, slots, strict=True)]  # fmt: skip
    stepped = runner.forward(decode)
    for i, (prompt, n, s) in enumerate(zip(prompts, nexts, slots, strict=True)):
        expected = reference_logits(tiny_dense.model, [*prompt, n], [None, *adapters][s])[-1]
        torch.testing.assert_close(stepped[i], expected, atol=2e-4, rtol=1e-4)
    # alone: the logits of the mixed batch, to fp32 rounding only. This fp32 model runs torch's
    # matmuls (MKL's sgemm), whose last bits move with the row count and even with a row's
    # address on AVX2 (1.0e-5 under emulate.avx2_only, 1.8e-5 on a Zen 3; MKL_CBWR does not
    # hold them across row counts): bit for bit is the native kernels' promise, tested below
    alone = runner.forward([StepRow(tables[2], len(prompts[2]), [nexts[2]], True, adapter=2)])
    torch.testing.assert_close(alone[0], stepped[2], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_adapters_on_the_native_kernels_change_their_rows_only(
    tiny_bf16_dir: Path, tmp_path: Path, mode: str
) -> None:
    """A GPTQ bf16 model on the CPU's fused kernels and native layer ops (the adapters' products
    in layer_ops.c's lora_add, in each of its modes), --batch-invariant so that 6 and 12 rows
    run the same matmul kernel: an adapter's rows move, every row is bit for bit as it is
    alone, and near torch's fp32 products."""
    from predictor.engine.runners.cpu import ModelRunner
    from predictor.model.loader import load_checkpoint
    from tests.support import tune_cache

    loaded = load_checkpoint(tiny_bf16_dir, device="cpu", threads=1)
    runner = ModelRunner(loaded.model, torch.device("cpu"), 64, 16, autotune_cache=tune_cache(),
                         batch_invariant=True)  # fmt: skip
    assert runner.lora.kernel is not None
    if mode == "int8" and not runner.lora.kernel.lora_int8:
        pytest.skip("no AVX-512 VNNI: lora_add has no int8 mode here")
    runner.lora.plan = [(1, mode)]
    adapter = load(write_adapter(tmp_path / "all", tiny_bf16_dir, 8, 3, std=0.2), loaded.model)
    runner.add_adapter(1, adapter.factors, adapter.scale)
    prompt = [11, 22, 33, 44, 55, 66]
    rows = [StepRow([0], 0, prompt, True, all_logits=True, adapter=0),
            StepRow([1], 0, prompt, True, all_logits=True, adapter=1)]  # fmt: skip
    mixed = runner.forward(rows)
    base_alone = runner.forward([StepRow([2], 0, prompt, True, all_logits=True)])
    adapted_alone = runner.forward([StepRow([3], 0, prompt, True, all_logits=True, adapter=1)])
    assert torch.equal(mixed[:6], base_alone) and torch.equal(mixed[6:], adapted_alone)
    kernel, runner.lora.kernel = runner.lora.kernel, None  # torch's matmuls: the same sums,
    by_torch = runner.forward([StepRow([4], 0, prompt, True, all_logits=True, adapter=1)])
    runner.lora.kernel = kernel  # rounded to bf16 once more (the delta, then the sum)
    difference = (by_torch - adapted_alone).abs().max().item()
    # int8: factors and activations quantized, each layer's error carried into the next
    share = 0.05 if mode == "bf16" else 0.1
    assert difference < share * (adapted_alone - base_alone).abs().max().item()
    assert (adapted_alone - base_alone).abs().max() > 0.5


def test_through_the_step_loop_rows_of_each_adapter_run_as_alone_and_share_no_blocks(
    tiny_dense: Tiny, adapters: list[Adapter]
) -> None:
    """Requests of two adapters and of the base model, with the same prompt, batched: each gets
    the tokens it gets alone; a prompt's cached blocks serve only requests of its adapter."""
    from predictor.types import SamplingParams
    from tests.engine.conftest import drive, make_sequence, new_loop

    prompt = [7, 3, 9, 12, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 60, 61]
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, seed=4)

    def serve(slots: list[int]) -> tuple[list[list[int]], list[int]]:
        runner = tiny_dense.runner(num_blocks=64, block_size=4)
        for slot, adapter in enumerate(adapters, start=1):
            runner.add_adapter(slot, adapter.factors, adapter.scale)
        loop = new_loop(runner, frozenset())
        made = [make_sequence(tiny_dense.tokenizer, prompt, params, f"r{i}")
                for i in range(len(slots))]  # fmt: skip
        for (request, _), slot in zip(made, slots, strict=True):
            request.adapter = slot
        # one at a time, so that a later request may find an earlier one's blocks cached
        drive(loop, {i: [r] for i, (r, _) in enumerate(made)}, [s for _, s in made])
        return [s.token_ids for _, s in made], [r.cached_prompt_tokens for r, _ in made]

    alone = [serve([slot])[0][0] for slot in (0, 1, 2)]
    assert len({tuple(tokens) for tokens in alone}) == 3  # each adapter samples its own
    tokens, cached = serve([0, 1, 2, 1])
    assert tokens == [*alone, alone[1]]
    # the base model's prompt blocks serve neither adapter; adapter 1's serve its second row
    assert cached[:3] == [0, 0, 0] and cached[3] > 0


@pytest.mark.parametrize("mode", ["bf16", "int8"])
@pytest.mark.parametrize("rank", [8, 16, 24, 80])
def test_lora_add_gives_a_row_the_same_sums_in_any_company(rank: int, mode: str) -> None:
    """layer_ops.c's lora_add, in each mode: 16 rows of one adapter in one call, interleaved
    with base rows, are bit for bit each row alone (the sums' order never depends on the rows
    beside it, which --batch-invariant relies on), the sums are the factors' products, and the
    base rows are left as they were."""
    from predictor.engine.runners.lora.weights import MODES
    from predictor.engine.runners.native.bindings import NativeUnavailable, layer_ops
    from predictor.engine.runners.native.layer_kernels import LayerKernels
    from predictor.types import run_to_end

    try:
        ops = layer_ops(64)
    except NativeUnavailable:
        pytest.skip("no C compiler: the torch path serves")
    kernels = LayerKernels.__new__(LayerKernels)
    kernels._ops = ops
    if mode == "int8" and not kernels.lora_int8:
        pytest.skip("no AVX-512 VNNI: lora_add has no int8 mode here")
    number, make = MODES[mode]
    generator = torch.Generator().manual_seed(rank)
    widths = [80, 72]  # 72: columns past the last whole vector of 16
    features_in = 98  # not a multiple of 4 (the int8 mode pads it)
    factors = {(0, module): (torch.randn(rank, features_in, generator=generator),
                             torch.randn(w, rank, generator=generator))
               for module, w in zip(("q_proj", "k_proj"), widths, strict=True)}  # fmt: skip
    a_groups, b_modules = run_to_end(make(factors, 1.0, torch.device("cpu")))
    a_group, b_ts = a_groups[(0, "qkv")], [b_modules[(0, m)] for m in ("q_proj", "k_proj")]
    padded = -(-rank // 16) * 16
    tables = [torch.tensor([a_group.data_ptr(), 0, 0]),
              torch.tensor([b.data_ptr() for b in b_ts] + [0]),
              torch.tensor([padded, padded, 0]), torch.tensor([0, 80, 0]),
              torch.tensor([*widths, 0])]  # fmt: skip
    call = torch.tensor([number, *(t.data_ptr() for t in tables), 3, features_in])
    x = torch.randn(20, features_in, generator=generator).to(torch.bfloat16)
    which = torch.tensor([0] * 16 + [-1] * 4)[torch.randperm(20, generator=generator)]
    order = torch.argsort(which, stable=True)
    start = torch.randn(20, 160, generator=generator).to(torch.bfloat16)
    together = start.clone()
    step = torch.tensor([20, which.data_ptr(), order.data_ptr()])
    kernels.lora_add(step.data_ptr(), call.data_ptr(), x, together)
    # and the sums themselves: fp32 products of the bf16 factors, rounded once into out (int8:
    # within 3% of the largest delta, the quantization of the factors and activations)
    a_t = [a.to(torch.bfloat16).float().T for a, _ in factors.values()]
    b_t = [b.to(torch.bfloat16).float().T for _, b in factors.values()]
    for i in range(20):
        alone = start[i : i + 1].clone()
        one = (which[i : i + 1].clone(), torch.zeros(1, dtype=torch.long))
        one_step = torch.tensor([1, one[0].data_ptr(), one[1].data_ptr()])
        kernels.lora_add(one_step.data_ptr(), call.data_ptr(), x[i : i + 1].contiguous(), alone)
        assert torch.equal(together[i : i + 1], alone)
        if int(which[i]) >= 0:
            h = [x[i].float() @ a for a in a_t]
            delta = torch.cat([h[0] @ b_t[0], h[1] @ b_t[1], torch.zeros(8)])
            expected = (start[i].float() + delta).to(torch.bfloat16).float()
            if mode == "bf16":
                assert torch.allclose(alone[0].float(), expected, rtol=1e-2, atol=1e-2)
            else:
                error = (alone[0].float() - expected).abs().max()
                assert error < 0.03 * delta.abs().max()
        assert torch.equal(together[i], start[i]) == (int(which[i]) < 0)
