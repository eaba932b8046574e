"""The examples of the README and of the topic pages under docs/, run as written against the test
server (host, port and model swapped)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from load.random_lora import write_adapter
from tests.support import REPO, ServerProcess

README = (REPO / "README.md").read_text()
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SNIPPET = re.compile(r"<!-- snippet: ([\w-]+) -->\n```\w+\n(.*?)```", re.S)
FOUND = [(page, name, code) for page in PAGES for name, code in SNIPPET.findall(page.read_text())]
SNIPPETS = {name: code for _, name, code in FOUND}


def adapt(code: str, server: ServerProcess) -> str:
    return (
        code.replace("localhost:8080", f"127.0.0.1:{server.http_port}")
        .replace("localhost:8081", f"127.0.0.1:{server.grpc_port}")
        .replace("smollm2-135m-instruct-gptq", server.model_name)
    )


def run(command: list[str]) -> str:
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_readme_opens_with_the_two_commands() -> None:
    head = README[: README.index("## ")]
    assert "make run" in head and "make test" in head


def test_the_map_comes_before_the_features() -> None:
    """The "Find your way" table is the first section, within the first screen."""
    sections = re.findall(r"^## (.+)$", README, re.M)
    assert sections[0] == "Find your way", sections
    assert README[: README.index("## Find your way")].count("\n") < 50


def test_the_docs_point_nowhere_outside_the_repository() -> None:
    for page in [*PAGES, REPO / "ARCHITECTURE.md", REPO / "load" / "README.md"]:
        assert "../shared" not in page.read_text(), page


def test_every_snippet_is_found_once() -> None:
    names = [name for _, name, _ in FOUND]
    assert len(names) == len(set(names)), names
    readme = {name for page, name, _ in FOUND if page.name == "README.md" and page.parent == REPO}
    assert readme == {"curl-infer", "tritonclient-http", "openai-sdk", "openai-lora"}
    assert set(SNIPPETS) == {
        "curl-infer",
        "tritonclient-http",
        "curl-stream",
        "httpx-sse",
        "tritonclient-grpc-stream",
        "openai-curl",
        "openai-sdk",
        "openai-structured",
        "openai-tools",
        "anthropic-sdk",
        "openai-responses",
        "tritonclient-vllm",
        "openai-lora",
    }


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_infer(server: ServerProcess) -> None:
    assert '"text_output"' in run(["bash", "-c", adapt(SNIPPETS["curl-infer"], server)])


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_stream(server: ServerProcess) -> None:
    out = run(["bash", "-c", adapt(SNIPPETS["curl-stream"], server)])
    assert out.count("data: ") >= 2 and '"finish_reason"' in out


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_openai(server: ServerProcess) -> None:
    assert '"object":"chat.completion"' in run(
        ["bash", "-c", adapt(SNIPPETS["openai-curl"], server)]
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("tritonclient-http", ""),
        ("httpx-sse", "generated_tokens"),
        ("tritonclient-grpc-stream", "'2':"),
        ("openai-sdk", "completion_tokens=32"),
        ("tritonclient-vllm", "{'decoupled': True}"),
    ],
)
def test_python_snippets(server: ServerProcess, name: str, expected: str) -> None:
    # the tiny random model may well answer in whitespace: check the structure, not the words
    out = run([sys.executable, "-c", adapt(SNIPPETS[name], server)])
    assert expected in out
    if name == "tritonclient-vllm":  # the tokens asked for in sampling_parameters, no more
        assert "tokens: 16" in out


def test_structured_outputs_snippet(server: ServerProcess) -> None:
    out = run([sys.executable, "-c", adapt(SNIPPETS["openai-structured"], server)])
    lines = out.splitlines()
    assert lines[0].startswith("{")  # JSON mode (the tiny model may not close it in 100 tokens)
    colour, reason = lines[1].split()
    assert colour in ("black", "white", "ginger", "grey") and reason == "stop"
    assert lines[2] in ("yes", "no")


def test_tool_call_snippet(server: ServerProcess) -> None:
    out = run([sys.executable, "-c", adapt(SNIPPETS["openai-tools"], server)])
    first, second = out.splitlines()
    assert first.startswith("tool_calls get_weather {'city': ")
    assert first.endswith(("'unit': 'celsius'}", "'unit': 'fahrenheit'}"))
    assert second == "True"


def test_anthropic_snippet(server: ServerProcess) -> None:
    out = run([sys.executable, "-c", adapt(SNIPPETS["anthropic-sdk"], server)])
    lines = out.splitlines()
    assert lines[0].startswith(("end_turn ", "max_tokens 32 ["))
    call = next(line for line in lines if line.startswith("tool_use get_weather {'city': "))
    assert call.endswith(("'unit': 'celsius'}", "'unit': 'fahrenheit'}"))
    assert lines[-2] == "True" and lines[-1].startswith("MessageTokensCount(input_tokens=")


def test_responses_snippet(server: ServerProcess) -> None:
    out = run([sys.executable, "-c", adapt(SNIPPETS["openai-responses"], server)])
    lines = out.splitlines()
    status, tokens = lines[0].split()
    assert status in ("completed", "incomplete") and int(tokens) > 0
    assert lines[-4] in ("completed", "incomplete")  # the stream's final status
    assert lines[-3] == "Cat"
    assert lines[-2] == "get_weather True" and lines[-1] == "message"


def test_lora_snippet(tiny_gptq_dir: Path, tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "sql", tiny_gptq_dir, 8, 1)
    extra = ["--lora-modules", f"sql={adapter}"]
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as server:
        out = run([sys.executable, "-c", adapt(SNIPPETS["openai-lora"], server)])
    listed, base, adapted = out.splitlines()
    assert listed == "['sql', 'tiny']"
    assert base.startswith("tiny ") and adapted.startswith("sql ")
