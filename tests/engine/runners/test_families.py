"""Every decoder family the CPU runner serves, on tiny random GPTQ checkpoints of each (built once
per run by load/random_gptq.py): the runner's greedy tokens against transformers' own model class
forwarding the same weights (dequantized exactly, fp32). With fp32 activations every token
agrees; with the default kernels (the autotune's pick, int8 activations here) the first does."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from load.random_gptq import SHAPES, Layout, write_checkpoint
from predictor.engine.runners.cpu import ModelRunner
from predictor.engine.runners.kernels.int4_linear import prepack_available
from predictor.model.loader import load_checkpoint
from tests.engine.runners.test_cpu import step_logits
from tests.support import ServerProcess, built_once, tune_cache

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
LAYOUTS = {  # served by gptqmodel's own modules where the runner cannot fuse them (act-order, 8 bits)
    "4bit-g32-asym": Layout(4, 32, sym=False),
    "4bit-g32-sym-v2-act-order": Layout(4, 32, sym=True, desc_act=True,
                                        checkpoint_format="gptq_v2"),
    "8bit-g64-asym": Layout(8, 64, sym=False),
    "4bit-per-channel-sym-fp16": Layout(4, -1, sym=True, dtype=torch.float16),
    # TheBloke's AutoGPTQ checkpoints: quantize_config.json beside config.json, 3 shards
    "4bit-g128-autogptq-sharded": Layout(4, 128, sym=True, quantize_config_file=True, shards=3),
    # gptqmodel's lm_head=True: transformers would load a random head; expanded from its codes
    "4bit-g128-sym-quantized-head": Layout(4, 128, sym=True, lm_head=True),
}  # fmt: skip
SHAPE = SHAPES["tiny"]
# Gemma 2's real attention cap (50) never binds on a tiny random model: a low one makes it
# and Gemma 3's window of 512 never slides over a 23-token prompt: one of 8 does
OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma2": {"attn_logit_softcapping": 2.0},
    "gemma3_text": {"sliding_window": 8},
}
HALF = SHAPE.head_dim // 2
# rope scaling as configs declare it: transformers' rotary module computes the tables the runner
# uses, so each type must give the reference's tokens (longrope past its original length: the
# long factors)
ROPE = {
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 256}),
    "linear": ("mistral", {"rope_type": "linear", "factor": 2.0}),
    "dynamic": ("qwen3", {"rope_type": "dynamic", "factor": 2.0}),
    "longrope": ("phi3", {"rope_type": "longrope", "short_factor": [1.0] * HALF,
                          "long_factor": [1.0 + i / 4 for i in range(HALF)],
                          "original_max_position_embeddings": 16}),
}  # fmt: skip


def checkpoint(
    workdir: Path, tokenizer_dir: Path, family: str, layout: str, rope: str | None = None
) -> Path:
    overrides = dict(OVERRIDES.get(family, {}))
    if rope is not None:
        params = {"rope_theta": SHAPE.rope_theta, **ROPE[rope][1]}
        overrides["rope_parameters"] = params
        if "original_max_position_embeddings" in params:  # Phi-3 reads it from the config
            overrides["original_max_position_embeddings"] = params[
                "original_max_position_embeddings"
            ]
    return built_once(
        workdir / "families" / f"{family}-{layout}{'-' + rope if rope else ''}",
        lambda out: write_checkpoint(out, SHAPE, LAYOUTS[layout], tokenizer_dir, seed=3,
                                     family=family, overrides=overrides),
    )  # fmt: skip


def reference(path: Path) -> torch.nn.Module:
    """transformers' own model class over the checkpoint's weights, dequantized, in fp32."""
    return load_checkpoint(path, device="cpu", threads=1, kernel="dequantized",
                           dtype=torch.float32).model  # fmt: skip


def reference_tokens(path: Path, prompt: list[int], count: int) -> list[int]:
    """The reference's greedy continuation."""
    model, ids = reference(path), list(prompt)
    with torch.inference_mode():
        for _ in range(count):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


# The runner's activations are bf16 (the checkpoint's dtype), the reference's fp32: logits differ
# by up to ~0.25 here, so where the reference's best two tokens are closer than this, either
# choice is the same model's.
TIE = 0.5


def check_continuation(path: Path, prompt: list[int], ours: list[int]) -> None:
    """Each of our tokens is the reference's choice at its position (transformers' forward of
    the same tokens, as test_model.py compares), or ties with it within bf16's error."""
    with torch.inference_mode():
        logits = reference(path)(torch.tensor([prompt + ours[:-1]])).logits[0].float()
    logits = logits[len(prompt) - 1 :]
    best = logits.max(-1).values
    chosen = logits[torch.arange(len(ours)), torch.tensor(ours)]
    assert bool((chosen >= best - TIE).all()), (best - chosen).tolist()
    exact = int((logits.argmax(-1) == torch.tensor(ours)).sum())
    assert exact >= len(ours) - 2


def greedy(runner: ModelRunner, prompt: list[int], count: int) -> list[int]:
    return [int(x[0].argmax()) for x in step_logits(runner, [prompt], count - 1)]


def fp32_activations(runner: ModelRunner) -> ModelRunner:
    """The model's own lm_head, not the autotune's pick (which may quantize its input)."""
    runner.kernels.choose()
    runner.kernels.head = runner._lm_head
    return runner


_RANDOM = random.Random(4)
PROMPT = [_RANDOM.randrange(100, 40000) for _ in range(23)]  # distinct tokens: values vary


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_gives_transformers_tokens(
    family: str, workdir: Path, tokenizer_dir: Path
) -> None:
    path = checkpoint(workdir, tokenizer_dir, family, "4bit-g32-asym")
    loaded = load_checkpoint(path, device="cpu", threads=1)
    assert type(loaded.model).__name__.lower().startswith(family.removesuffix("_text"))
    exact = ModelRunner(loaded.model, torch.device("cpu"), 64, 16, kernel="native_f32",
                        autotune_cache=tune_cache())  # fmt: skip
    assert all(f is not None for f in exact._fused), "every layer fused (Qwen2's biases too)"
    if family.startswith("gemma"):  # soft caps, windows: torch's attention, its own norms
        assert exact._native is None and exact._ops is None
    else:
        assert exact._ops is not None  # native attention and layer kernels
    check_continuation(path, PROMPT, greedy(fp32_activations(exact), PROMPT, 12))
    default = ModelRunner(loaded.model, torch.device("cpu"), 64, 16, autotune_cache=tune_cache())
    assert greedy(default, PROMPT, 1) == reference_tokens(path, PROMPT, 1)


@pytest.mark.parametrize("rope", sorted(ROPE))
def test_each_rope_scaling_gives_transformers_tokens(
    rope: str, workdir: Path, tokenizer_dir: Path
) -> None:
    family = ROPE[rope][0]
    path = checkpoint(workdir, tokenizer_dir, family, "4bit-g32-asym", rope)
    loaded = load_checkpoint(path, device="cpu", threads=1)
    assert loaded.model.config.rope_parameters["rope_type"] == ROPE[rope][1]["rope_type"]
    exact = ModelRunner(loaded.model, torch.device("cpu"), 64, 16, kernel="native_f32",
                        autotune_cache=tune_cache())  # fmt: skip
    check_continuation(path, PROMPT, greedy(fp32_activations(exact), PROMPT, 8))


@pytest.mark.parametrize("layout", sorted(set(LAYOUTS) - {"4bit-g32-asym"}))
def test_each_layout_gives_transformers_first_token(
    layout: str, workdir: Path, tokenizer_dir: Path
) -> None:
    path = checkpoint(workdir, tokenizer_dir, "qwen2", layout)
    expected = reference_tokens(path, PROMPT, 4)
    loaded = load_checkpoint(path, device="cpu", threads=1)
    runner = ModelRunner(loaded.model, torch.device("cpu"), 64, 16, autotune_cache=tune_cache())
    if LAYOUTS[layout].bits == 8:  # expanded to bf16 at load, prepacked for oneDNN
        assert loaded.kernel == "Linear (dequantized)"
        q_proj = loaded.model.model.layers[0].self_attn.q_proj
        # oneDNN's prepacked linear needs AVX-512 (or AVX-NE-CONVERT): torch's Linear elsewhere
        assert type(q_proj).__name__ == ("PrepackedLinear" if prepack_available() else "Linear")
    if LAYOUTS[layout].desc_act:  # fused too: rows reordered at load, one gather a call
        first = runner._fused[0]
        assert all(f is not None for f in runner._fused)
        assert first is not None and first.qkv.order is not None
    if LAYOUTS[layout].lm_head:
        want = reference(path).lm_head.weight
        assert torch.allclose(loaded.model.lm_head.weight.float(), want, rtol=0.01, atol=1e-3)
    got = greedy(runner, PROMPT, 4)
    assert got[0] == expected[0]


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_a_checkpoint_is_served(family: str, workdir: Path, tokenizer_dir: Path) -> None:
    """The real server on a Qwen3 checkpoint (native attention) and a Gemma 3 one (windows
    sliding past the prompt, torch attention): OpenAI completions' greedy tokens are
    transformers' (fp32-activation projections)."""
    import httpx

    path = checkpoint(workdir, tokenizer_dir, family, "4bit-g32-asym")
    extra = ["--kernel", "native_f32", "--attention", "auto"]
    with ServerProcess.start(path, "tiny", extra=extra) as server:
        answer = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                  "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True},
            timeout=120,
        )  # fmt: skip
    assert answer.status_code == 200, answer.text
    tokens = answer.json()["choices"][0]["logprobs"]["tokens"]
    ours = [int(t.removeprefix("token_id:")) for t in tokens]
    assert len(ours) == 8 and ours[0] == reference_tokens(path, PROMPT, 1)[0]
    check_continuation(path, PROMPT, ours)


SERVED_READER = [  # per-channel: TorchAtenLinear takes groups of 16-128 only; gptqmodel's others
    ("qwen2", name)
    for name, layout in sorted(LAYOUTS.items())
    if layout.bits == 4 and layout.group_size > 0
]
SERVED_READER += [("phi3", "4bit-g32-asym"), ("gemma3_text", "4bit-g32-asym")]


@pytest.mark.parametrize(("family", "layout"), SERVED_READER)
def test_the_server_reads_a_checkpoint_without_gptqmodel(
    family: str, layout: str, workdir: Path, tokenizer_dir: Path
) -> None:
    """The server's reader (`served=True`: model/gptq.py, no gptqmodel) gives the runner what
    gptqmodel's TorchAtenLinear gives it: every layer fused (act-order's rows sorted once, at
    load, either way), the same logits to the bit."""
    path = checkpoint(workdir, tokenizer_dir, family, layout)
    logits = []
    for served in (False, True):
        kernel = "auto" if served else "gptq_torch_aten"  # gptqmodel's own pick may be another
        loaded = load_checkpoint(path, device="cpu", threads=1, kernel=kernel, served=served)
        assert loaded.kernel == ("GPTQLinear" if served else "TorchAtenLinear")
        runner = ModelRunner(loaded.model, torch.device("cpu"), 64, 16, kernel="native_f32",
                             autotune_cache=tune_cache())  # fmt: skip
        assert all(f is not None for f in runner._fused)
        logits.append(torch.cat([x.float() for x in step_logits(runner, [PROMPT], 3)]))
    assert torch.equal(logits[0], logits[1])
