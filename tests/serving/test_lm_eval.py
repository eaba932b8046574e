"""EleutherAI's lm-evaluation-harness (`--model local-completions`, the usual way to score a
served model) runs a small local multiple-choice task against the real server: its
loglikelihood requests are token-id prompts with echo, logprobs and max_tokens 1. It runs as
load/lm_eval_compare.py runs it, through lm-eval's `simple_evaluate` (what `lm_eval run` calls)
with a task manager that indexes only the task's folder, in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from load.lm_eval_compare import write_task
from predictor.model.loader import LoadedModel
from tests.support import REPO, ServerProcess

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


# lm-eval reads its offline settings when it is imported: a process of its own, set up first
RUN_TASK = """
import json, sys
from pathlib import Path
from load.lm_eval_compare import evaluate, offline_env
work, model_args, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
offline_env(work)
out.write_text(json.dumps(evaluate("local-completions", model_args, work / "tasks", None)))
"""


def test_lm_eval_local_completions_scores_a_task(
    server: ServerProcess, tokenizer_dir: Path, tmp_path: Path, tiny_gptq: LoadedModel
) -> None:
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    write_task(tmp_path / "tasks", data)
    out = tmp_path / "out.json"
    model_args = (
        f"model=tiny,base_url={server.base_url}/v1/completions,tokenizer={tokenizer_dir},"
        "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"
    )
    run = subprocess.run(
        [sys.executable, "-c", RUN_TASK, str(tmp_path), model_args, str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert 0.0 <= result["acc"] <= 1.0
    assert [doc for doc, _ in result["samples"]] == list(range(len(QUESTIONS)))
    assert [doc for doc, _ in result["requests"]] == list(range(len(QUESTIONS)))
    for (doc, scores), (_, requests) in zip(result["samples"], result["requests"], strict=True):
        # one log-likelihood per choice, from the server's echo logprobs
        assert len(scores) == len(requests) == len(QUESTIONS[doc]["choices"])
        for score, (context, continuation) in zip(scores, requests, strict=True):
            assert continuation.strip() in QUESTIONS[doc]["choices"]
            expected = loglikelihood(tiny_gptq, context, continuation)
            assert score == pytest.approx(expected, rel=2**-6, abs=0.02)
