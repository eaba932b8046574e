"""The default model served as a user starts it, with no flags at all (native attention, the
autotune's kernels, speculation from the request's own text and from recent answers): one
request gives one text, whichever way it is sent and whatever shares its steps.

Repeats draft from the earlier answers (the issue this guards: a third send verified drafts in
steps of several rows and gave another text), 12 at once share every step with other rows, a
stream and a whole answer are the same tokens, and `speculative: false` changes no token."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest

from load.random_lora import write_adapter
from tests.conftest import DEFAULT_MODEL
from tests.support import ServerProcess

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        not DEFAULT_MODEL.is_dir(), reason="run `make model` first (make test does)"
    ),
]

NAME = "smollm2-135m-instruct-gptq"
POEM = "Write a poem about the sea."
# the other rows of the 12 sent at once: prompts of other lengths, so prompt chunks, decode rows
# and drafts share steps with the request checked
OTHERS = [
    "List five fruits.",
    "What is the capital of France? Answer in one word.",
    "Explain in two sentences why the sky is blue.",
    "Count from one to ten in words.",
    "Translate 'good morning' into French, German and Spanish.",
    "Write a haiku about autumn leaves falling on a quiet pond at dusk.",
]
GREEDY: dict[str, Any] = {"max_tokens": 48, "temperature": 0}
SEEDED: dict[str, Any] = {"max_tokens": 48, "temperature": 0.7, "seed": 11}


@pytest.fixture(scope="module")
def default_server() -> Iterator[ServerProcess]:
    with ServerProcess.start(DEFAULT_MODEL, NAME) as proc:  # no flags: the defaults
        yield proc


def generate(server: ServerProcess, prompt: str, model: str = NAME, **parameters: Any) -> str:
    body = {"text_input": prompt, "parameters": {"chat": True, **parameters}}
    r = httpx.post(f"{server.base_url}/v2/models/{model}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["text_output"])


def generate_stream(server: ServerProcess, prompt: str, **parameters: Any) -> str:
    body = {"text_input": prompt, "parameters": {"chat": True, **parameters}}
    text = []
    url = f"{server.base_url}/v2/models/{NAME}/generate_stream"
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                text.append(event["text_output"])
    return "".join(text)


def at_once(
    server: ServerProcess, prompts: list[str], model: str = NAME, **parameters: Any
) -> list[str]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: generate(server, p, model, **parameters), prompts))


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("parameters", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_request_gives_one_text_repeated_streamed_and_batched(
    default_server: ServerProcess, parameters: dict[str, Any]
) -> None:
    first = generate(default_server, POEM, **parameters)
    assert first
    repeats = [generate(default_server, POEM, **parameters) for _ in range(3)]
    assert repeats == [first] * 3  # sends 2-4 draft from the earlier answers
    assert generate_stream(default_server, POEM, **parameters) == first
    assert generate(default_server, POEM, speculative=False, **parameters) == first
    alone = {p: generate(default_server, p, **parameters) for p in OTHERS}
    together = at_once(default_server, [POEM] * 6 + OTHERS, **parameters)
    assert together[:6] == [first] * 6
    assert together[6:] == [alone[p] for p in OTHERS]


def test_openai_chat_streamed_and_whole_are_one_text(default_server: ServerProcess) -> None:
    messages = [{"role": "user", "content": POEM}]
    texts = []
    for _ in range(2):
        whole = client(default_server).chat.completions.create(
            model=NAME, messages=messages, max_tokens=40, temperature=0.7, seed=5
        )  # fmt: skip
        texts.append(whole.choices[0].message.content)
    stream = client(default_server).chat.completions.create(
        model=NAME, messages=messages, max_tokens=40, temperature=0.7, seed=5, stream=True
    )  # fmt: skip
    texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    assert texts[0] and texts == [texts[0]] * 3


def test_structured_output_is_one_text_with_and_without_drafts(
    default_server: ServerProcess,
) -> None:
    """A seeded JSON-mode chat at temperature 0.7 (the text differed with speculation)."""
    messages = [{"role": "user", "content": "Describe a cat as JSON with its name and age."}]

    def ask(**extra: Any) -> str:
        out = client(default_server).chat.completions.create(
            model=NAME, messages=messages, max_tokens=60, temperature=0.7, seed=3,
            response_format={"type": "json_object"}, extra_body=extra,
        )  # fmt: skip
        return str(out.choices[0].message.content)

    texts = [ask() for _ in range(3)] + [ask(speculative=False)]
    assert texts == [texts[0]] * 4
    if not texts[0].rstrip().endswith("}"):
        return  # cut by max_tokens: a prefix of a JSON object, still one text
    assert isinstance(json.loads(texts[0]), dict)


def test_tool_calls_are_one_answer_with_and_without_drafts(default_server: ServerProcess) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    }}]  # fmt: skip
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]

    def ask(**extra: Any) -> list[tuple[str, dict[str, Any]]]:
        out = client(default_server).chat.completions.create(
            model=NAME, messages=messages, tools=tools, tool_choice="required", max_tokens=80,
            temperature=0.7, seed=9, extra_body=extra,
        )  # fmt: skip
        calls = out.choices[0].message.tool_calls or []
        assert calls, out.choices[0]
        return [(c.function.name, json.loads(c.function.arguments)) for c in calls]

    answers = [ask() for _ in range(3)] + [ask(speculative=False)]
    assert answers == [answers[0]] * 4
    assert all(name == "get_weather" and "city" in args for name, args in answers[0])


def test_anthropic_messages_is_chats_text_and_round_trips_a_tool(
    default_server: ServerProcess,
) -> None:
    """The anthropic SDK on the default model: a greedy message is the chat template's greedy
    text, whole and streamed; a forced call validates and its result gets a text answer."""
    sdk = anthropic.Anthropic(base_url=default_server.base_url, api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": POEM}]
    out = sdk.messages.create(model=NAME, max_tokens=48, messages=ask, extra_body=GREEDY)
    (block,) = out.content
    assert block.type == "text" and block.text == generate(default_server, POEM, **GREEDY)
    with sdk.messages.stream(model=NAME, max_tokens=48, messages=ask, extra_body=GREEDY) as s:
        assert "".join(s.text_stream) == block.text
    tools: list[Any] = [{
        "name": "get_weather", "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]},
    }]  # fmt: skip
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    # greedy and one call: Anthropic's default temperature is 1, and an unseeded sample could
    # go on calling until max_tokens
    called = sdk.messages.create(
        model=NAME, max_tokens=120, messages=messages, tools=tools, extra_body={"temperature": 0},
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    calls = [b for b in called.content if b.type == "tool_use"]
    assert called.stop_reason == "tool_use" and len(calls) == 1, called
    assert all(c.name == "get_weather" and isinstance(c.input.get("city"), str) for c in calls)
    messages += [
        {"role": "assistant", "content": called.content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": c.id, "content": "18 degrees and sunny"}
            for c in calls
        ]},
    ]  # fmt: skip
    answer = sdk.messages.create(model=NAME, max_tokens=40, messages=messages, tools=tools)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.content and answer.usage.output_tokens > 0


@pytest.fixture(scope="module")
def adapted_default(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    adapter = write_adapter(tmp_path_factory.mktemp("lora") / "poet", DEFAULT_MODEL, 8, 1,
                            std=0.05)  # fmt: skip
    with ServerProcess.start(DEFAULT_MODEL, NAME, extra=["--lora-modules", f"poet={adapter}"]) as s:
        yield s


def test_an_adapter_request_gives_one_text_alone_and_beside_the_base(
    adapted_default: ServerProcess,
) -> None:
    """LoRA (its only flag, --lora-modules) under the default speculation: an adapter's rows
    and the base model's share steps, each gives the text it gives alone."""
    base = generate(adapted_default, POEM, **GREEDY)
    first = generate(adapted_default, POEM, "poet", **GREEDY)
    assert first != base  # the adapter changes its rows
    assert [generate(adapted_default, POEM, "poet", **GREEDY) for _ in range(2)] == [first] * 2
    with ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(generate, adapted_default, POEM, m, **GREEDY)
                for m in ["poet", NAME] * 4]  # fmt: skip
        texts = [job.result() for job in jobs]
    assert texts == [first, base] * 4


def test_the_defaults_are_served(default_server: ServerProcess) -> None:
    """The log names what served: native attention and the autotune's measured kernels, one
    kernel a matmul at every row count, speculation on."""
    log = default_server.log()
    assert "native decode attention ready" in log
    chosen = [line for line in log.splitlines() if "kernel (measured)" in line
              or "kernel (cache " in line]  # fmt: skip
    assert len(chosen) >= 2, log[-3000:]  # the fused projections' shapes and lm_head
    for line in chosen:
        assert line.count(" rows ") == 1, line  # one kernel at every row count
    held = re.search(r"kernels' copies of the weights: (\d+) MB \(budget (\d+) MB\)", log)
    assert held is not None and int(held[1]) <= int(held[2]) == 1000, log[-3000:]
