"""--batch-invariant through the real server: the same completions, greedy and seeded, for
requests sent one by one and all at once (prefix-cache hits included)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.serving.test_openai import client
from tests.support import ServerProcess


@pytest.fixture(scope="module")
def invariant(tiny_bf16_dir: Path) -> Iterator[ServerProcess]:
    # the default kernels and attention (native on this bf16 model), not the tests' torch ones
    extra = ["--batch-invariant", "true", "--kernel", "auto", "--attention", "auto"]
    with ServerProcess.start(tiny_bf16_dir, "tiny", extra=extra) as proc:
        yield proc


def test_requests_get_the_same_text_alone_and_together(invariant: ServerProcess) -> None:
    document = " ".join(f"line {i} of the shared document." for i in range(12))
    prompts = [f"{document} Question {i}?" if i % 2 else f"Question {i}?" for i in range(8)]

    def complete(i: int) -> str:
        seeded = {"temperature": 0.9, "seed": i} if i % 3 == 0 else {"temperature": 0.0}
        out = client(invariant).completions.create(
            model="tiny",
            prompt=prompts[i],
            max_tokens=16,
            **seeded,  # type: ignore[arg-type]
        )
        return out.choices[0].text

    alone = [complete(i) for i in range(len(prompts))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(complete, range(len(prompts))))
    assert together == alone
