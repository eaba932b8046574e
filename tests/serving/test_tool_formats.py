"""Each family's tool-call format through the real server, on a tiny random-weight checkpoint
of the family with its real chat template (tests/engine/tool_formats/templates/): the format
is chosen from the template, forced calls (`required`, a named tool) parse and validate in
100% of 20 requests, unary and streamed (random weights: the grammar guarantees it), and the
tool round trip (call, tool result, answer) renders through the template."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import pytest

from load.random_gptq import SHAPES, Layout, write_checkpoint
from tests.serving.test_openai import client
from tests.serving.test_tool_calls import ASK, TOOLS, check_calls
from tests.support import ServerProcess, built_once

TEMPLATES = Path(__file__).parents[1] / "engine" / "tool_formats" / "templates"
# label -> (the checkpoint's family, its template, the format it asks for)
FAMILIES = {
    "llama3.2": ("llama", "llama-3.2.jinja", "llama3_json"),
    "mistral-v0.3": ("mistral", "mistral-7b-instruct-v0.3.jinja", "mistral"),
    "phi-4-mini": ("phi3", "phi-4-mini-instruct.jinja", "phi4_mini_json"),
    "qwen3": ("qwen3", "qwen3.jinja", "hermes"),  # renders `tools` itself
    "gemma3": ("gemma3_text", "gemma-3.jinja", "pythonic"),  # Python calls, as Gemma's guide
}
NAMED = {"type": "function", "function": {"name": "convert"}}


def family_checkpoint(workdir: Path, tokenizer_dir: Path, label: str) -> Path:
    family, template, _ = FAMILIES[label]

    def build(out: Path) -> None:
        tokens = out.with_name(out.name + "-tokenizer")
        shutil.rmtree(tokens, ignore_errors=True)
        shutil.copytree(tokenizer_dir, tokens)
        shutil.copyfile(TEMPLATES / template, tokens / "chat_template.jinja")
        write_checkpoint(out, SHAPES["tiny"], Layout(4, 32), tokens, seed=5, family=family)

    return built_once(workdir / "tool-formats" / label, build)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_server(
    request: pytest.FixtureRequest, workdir: Path, tokenizer_dir: Path
) -> Iterator[tuple[str, ServerProcess]]:
    path = family_checkpoint(workdir, tokenizer_dir, request.param)
    with ServerProcess.start(path, "tiny", extra=["--max-tokens-limit", "512"]) as server:
        yield FAMILIES[request.param][2], server


def streamed_calls(server: ServerProcess, **kwargs: Any) -> dict[int, tuple[str, list[Any]]]:
    """Each choice's finish reason and calls, put together from a stream's deltas."""
    choices: dict[int, tuple[str, list[Any]]] = {}
    calls: dict[int, dict[int, dict[str, str]]] = {}
    finishes: dict[int, str] = {}
    for chunk in client(server).chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                assert piece.function is not None
                got = calls.setdefault(choice.index, {})
                if piece.id is not None:
                    got[piece.index] = {"id": piece.id, "name": piece.function.name or "",
                                        "arguments": ""}  # fmt: skip
                got[piece.index]["arguments"] += piece.function.arguments or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    for index, finish in finishes.items():
        made = [_Call(c["id"], c["name"], c["arguments"]) for c in calls.get(index, {}).values()]
        choices[index] = (finish, made)
    return choices


class _Call:
    """A streamed call in the shape `check_calls` reads (the SDK's message call)."""

    def __init__(self, id: str, name: str, arguments: str) -> None:
        self.id, self.type = id, "function"
        self.function = type("F", (), {"name": name, "arguments": arguments})()


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_always_parse_in_the_familys_format(
    family_server: tuple[str, ServerProcess], choice: str
) -> None:
    fmt, server = family_server
    assert f"tool calls in the {fmt} format" in server.log()
    wanted: Any = NAMED if choice == "named" else "required"
    kwargs: dict[str, Any] = dict(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=wanted, n=4, temperature=0.9,
        max_tokens=300, parallel_tool_calls=False,
    )  # fmt: skip
    for seed in range(5):  # 5 requests of 4 choices: 20, unary
        out = client(server).chat.completions.create(**kwargs, seed=seed)
        for c in out.choices:
            assert c.finish_reason == "tool_calls", (fmt, c.message)
            names = check_calls(c.message.tool_calls)
            assert names == ["convert"] if choice == "named" else len(names) == 1
    for seed in range(5, 10):  # and 20 streamed
        for finish, made in streamed_calls(server, **kwargs, seed=seed).values():
            assert finish == "tool_calls", (fmt, made)
            names = check_calls(made)
            assert names == ["convert"] if choice == "named" else len(names) == 1


def test_a_tool_round_trip_renders_through_the_template(
    family_server: tuple[str, ServerProcess],
) -> None:
    fmt, server = family_server
    tools = TOOLS[:1]  # Llama's template indents it: the tiny model's context is short
    called = client(server).chat.completions.create(
        model="tiny", messages=ASK, tools=tools, tool_choice="required", seed=3,
        temperature=0.9, max_tokens=300, parallel_tool_calls=False,
    )  # fmt: skip
    calls = called.choices[0].message.tool_calls
    assert calls
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        *({"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": True})}
          for c in calls),
    ]  # fmt: skip
    answer = client(server).chat.completions.create(
        model="tiny", messages=history, tools=tools, max_tokens=16, seed=1
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls"), fmt


def test_messages_and_responses_read_the_familys_calls(
    family_server: tuple[str, ServerProcess],
) -> None:
    """Anthropic's tool_use blocks and the Responses API's function_call items come from the same
    format's parser, streamed and not."""
    fmt, server = family_server
    weather = TOOLS[0]["function"]
    sdk = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    tools: Any = [{"name": weather["name"], "input_schema": weather["parameters"]}]
    asked: dict[str, Any] = dict(
        model="tiny", max_tokens=200, messages=ASK, tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    answer = sdk.messages.create(**asked)
    with sdk.messages.stream(**asked) as stream:
        streamed = stream.get_final_message()
    for message in (answer, streamed):
        uses = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and len(uses) == 1, (fmt, message)
        jsonschema.validate(uses[0].input, weather["parameters"])
    function: Any = [{"type": "function", **weather}]
    response = client(server).responses.create(
        model="tiny", input="Weather in Paris?", tools=function, tool_choice="required",
        max_output_tokens=200, parallel_tool_calls=False,
    )  # fmt: skip
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1, (fmt, response.output)
    jsonschema.validate(json.loads(calls[0].arguments), weather["parameters"])
