"""lm-evaluation-harness through the server against lm-eval's `hf` backend in process.

Both score the same local multiple-choice task (load/mc_questions.jsonl: 100 project-written
questions, simple facts and arithmetic) on the same GPTQ checkpoint: `local-completions`
sends each context + choice as token ids with echo and logprobs (our server, its engine and
kernels); `hf` runs the checkpoint as transformers loads it (our loader's `load_checkpoint`,
the GPTQ kernels of gptqmodel) in this process. The goal: the two accuracies equal within one
question in twenty. Prints both accuracies, how many questions got the same answer, and the
largest per-choice log-likelihood difference.

    python -m load.lm_eval_compare                 # starts the server on the default model
    python -m load.lm_eval_compare --limit 20      # a quick look

`write_task` is also what tests/serving/test_lm_eval.py uses to write its task.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from load.local_server import REPO, local_server

QUESTIONS = REPO / "load" / "mc_questions.jsonl"
TASK = "gptq_predictor_mc"


def write_task(folder: Path, questions: Path, name: str = TASK) -> Path:
    """An lm-eval multiple-choice task over a JSONL of {question, choices, answer (index)}
    rows, written into `folder` (pass it as lm-eval's include_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {json.dumps(str(questions))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\n"
        "metric_list:\n"
        "  - metric: acc\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n"
    )
    return path


def offline_env(cache: Path) -> None:
    """No hub: datasets and tokenizers come from local files only."""
    os.environ.update(
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(cache / "hf"), HF_DATASETS_CACHE=str(cache / "datasets"),
        TOKENIZERS_PARALLELISM="false",
    )  # fmt: skip


def evaluate(model: Any, model_args: str | None, tasks: Path, limit: int | None) -> dict:
    """One lm-eval run of the task: {"acc": ..., "samples": [(doc id, [loglikelihoods])],
    "requests": [(doc id, [(context, continuation)])]}, a request a choice, as lm-eval split
    the text. Its task manager indexes the task folder only: `lm_eval run` indexes lm-eval's
    ~10,000 built-in tasks first (18 s, Xeon, 2 cores), whatever `--tasks` asks for."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model, model_args=model_args, tasks=[TASK], limit=limit,
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True, bootstrap_iters=0,
    )  # fmt: skip
    assert out is not None
    rows = out["samples"][TASK]
    samples = [(s["doc_id"], [float(r[0][0]) for r in s["resps"]]) for s in rows]
    requests = [(s["doc_id"], [(str(a[0]), str(a[1])) for a in s["arguments"]]) for s in rows]
    return {"acc": float(out["results"][TASK]["acc,none"]), "samples": sorted(samples),
            "requests": sorted(requests)}  # fmt: skip


def compare(served: dict, local: dict) -> dict[str, Any]:
    """Both accuracies, the questions answered alike and the largest log-likelihood gap."""
    same, gaps = 0, []
    for (doc, ours), (doc2, theirs) in zip(served["samples"], local["samples"], strict=True):
        assert doc == doc2
        same += max(range(len(ours)), key=ours.__getitem__) == max(
            range(len(theirs)), key=theirs.__getitem__
        )
        gaps.extend(abs(a - b) for a, b in zip(ours, theirs, strict=True))
    count = len(served["samples"])
    return {
        "questions": count, "served_acc": served["acc"], "hf_acc": local["acc"],
        "same_answer": same, "max_loglikelihood_gap": round(max(gaps), 4),
        "median_loglikelihood_gap": round(statistics.median(gaps), 4),
        "within_one_in_twenty": abs(served["acc"] - local["acc"]) * count <= count / 20,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct-gptq")
    parser.add_argument("--model-dir", default="models/smollm2-135m-instruct-gptq")
    parser.add_argument("--questions", type=Path, default=QUESTIONS)
    parser.add_argument("--limit", type=int, default=None, help="the first N questions only")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lm-eval-compare"))
    parser.add_argument("--server-args", default="--threads 1", help="flags for the server")
    args = parser.parse_args()
    offline_env(args.work)
    tasks = args.work / "tasks"
    write_task(tasks, args.questions.resolve())
    model_dir = str((REPO / args.model_dir).resolve())
    log = args.work / "server.log"
    started = time.monotonic()
    with local_server(model_dir, args.model, log, extra=args.server_args.split()) as server:
        served = evaluate(
            "local-completions",
            f"model={args.model},base_url={server.base_url}/v1/completions,"
            f"tokenizer={model_dir},tokenizer_backend=huggingface,tokenized_requests=True,"
            "num_concurrent=1,max_retries=1",
            tasks, args.limit,
        )  # fmt: skip
    served_s = time.monotonic() - started
    import torch
    from lm_eval.models.huggingface import HFLM

    from predictor.model.loader import load_checkpoint

    torch.set_num_threads(1)
    started = time.monotonic()
    loaded = load_checkpoint(Path(model_dir), device="cpu", threads=1)
    hf = HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=1, device="cpu")
    local = evaluate(hf, None, tasks, args.limit)
    report = compare(served, local)
    report |= {"served_s": round(served_s, 1), "hf_s": round(time.monotonic() - started, 1)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
