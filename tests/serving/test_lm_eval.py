"""EleutherAI's lm-evaluation-harness (`lm_eval --model local-completions`, the usual way to
score a served model) runs a small local multiple-choice task against the real server: its
loglikelihood requests are token-id prompts with echo, logprobs and max_tokens 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from load.lm_eval_compare import TASK, write_task
from predictor.model.loader import LoadedModel
from tests.support import ServerProcess

QUESTIONS = [
    {"question": "What color is the sky?", "choices": ["blue", "green", "red"], "answer": 0},
    {"question": "What is 2 plus 2?", "choices": ["3", "4", "5"], "answer": 1},
    {"question": "How many legs does a cat have?", "choices": ["two", "six", "four"], "answer": 2},
    {"question": "What is the capital of France?", "choices": ["Rome", "Paris"], "answer": 1},
]


def loglikelihood(loaded: LoadedModel, context: str, continuation: str) -> float:
    """The continuation's log-likelihood after the context, as lm-eval splits the tokens
    (the whole text encoded, the context's tokens first), from one forward pass here."""
    whole = loaded.tokenizer.encode(context + continuation, add_special_tokens=False)
    start = len(loaded.tokenizer.encode(context, add_special_tokens=False))
    with torch.no_grad():
        logits = loaded.model(torch.tensor([whole])).logits[0].float()  # [S, V]
    logp = torch.log_softmax(logits, dim=-1)
    return sum(float(logp[t - 1, whole[t]]) for t in range(start, len(whole)))


def test_lm_eval_local_completions_scores_a_task(
    server: ServerProcess, tokenizer_dir: Path, tmp_path: Path, tiny_gptq: LoadedModel
) -> None:
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    write_task(tmp_path / "tasks", data)
    out = tmp_path / "out"
    env = os.environ | {
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        "TOKENIZERS_PARALLELISM": "false",
    }  # fmt: skip
    model_args = (
        f"model=tiny,base_url={server.base_url}/v1/completions,tokenizer={tokenizer_dir},"
        "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"
    )
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
         "--model_args", model_args, "--tasks", TASK, "--include_path", str(tmp_path / "tasks"),
         "--output_path", str(out), "--log_samples"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (results,) = out.rglob("results_*.json")
    acc = json.loads(results.read_text())["results"][TASK]["acc,none"]
    assert 0.0 <= acc <= 1.0
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == len(QUESTIONS)
    for row in rows:  # one log-likelihood per choice, from the server's echo logprobs
        assert len(row["resps"]) == len(row["doc"]["choices"])
        for (resp,), args in zip(row["resps"], row["arguments"].values(), strict=True):
            expected = loglikelihood(tiny_gptq, args["arg_0"], args["arg_1"])
            assert float(resp[0]) == pytest.approx(expected, rel=2**-6, abs=0.02)
