"""An adapter trained with peft (a few steps, rank 8, on the tiny model) and served: the server's
greedy tokens are those of peft's merged model in this process. The model is served on the fp32
path (`--loader-kernel dequantized`: the GPTQ weights expanded into plain Linear layers, which is also
what peft adapts here), so the two differ only in the order of fp32 sums."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import torch

from tests.support import ServerProcess

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TEXT = "The capital of France is Paris. The capital of Italy is Rome. " * 3
PROMPT = "The capital of France is Paris. The capital"


def dequantized(folder: Path) -> Any:
    from predictor.model.loader import load_checkpoint

    loaded = load_checkpoint(folder, device="cpu", kernel="dequantized", dtype=torch.float32)
    return loaded.model, loaded.tokenizer


def train(folder: Path, out: Path) -> Path:
    """peft's LoRA on every projection, 12 AdamW steps on one text (a fixed seed)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model, tokenizer = dequantized(folder)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=MODULES)
    tuned = get_peft_model(model, config)
    ids = torch.tensor([tokenizer(TEXT).input_ids])
    optimizer = torch.optim.AdamW([p for p in tuned.parameters() if p.requires_grad], lr=1e-2)
    tuned.train()
    losses = []
    with torch.enable_grad():
        for _ in range(12):
            loss = tuned(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]  # it learnt the text
    tuned.save_pretrained(out)
    return out


def greedy(model: Any, ids: list[int], count: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(count):
            logits = model(input_ids=torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


def test_a_peft_trained_adapter_serves_the_merged_models_tokens(
    tiny_gptq_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel

    adapter = train(tiny_gptq_dir, tmp_path / "trained")
    base, tokenizer = dequantized(tiny_gptq_dir)
    prompt = tokenizer(PROMPT).input_ids
    base_tokens = greedy(base, prompt, 16)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()
    expected = greedy(merged, prompt, 16)
    assert expected != base_tokens  # the training moved the model
    extra = ["--loader-kernel", "dequantized", "--lora-modules", f"trained={adapter}"]
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as server:
        served = {}
        for model in ("tiny", "trained"):
            body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
            served[model] = tokenizer(text, add_special_tokens=False).input_ids
    for model, tokens in (("trained", expected), ("tiny", base_tokens)):
        text = tokenizer.decode(tokens)
        assert served[model] == tokenizer(text, add_special_tokens=False).input_ids
