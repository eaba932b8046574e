"""Tool-call formats, one module each behind one interface (`base.ToolFormat`: how tools and
tool turns reach the chat template, the grammar that forces calls, the parser that reads them):

| parser name      | family                                  | calls as the model writes them |
|------------------|-----------------------------------------|--------------------------------|
| `hermes`         | Qwen2.5, Qwen3, Hermes, SmolLM3; default | `<tool_call>{...}</tool_call>` |
| `llama3_json`    | Llama 3.1 / 3.2 / 3.3                    | `{"name", "parameters"}`       |
| `mistral`        | Mistral v0.3, Nemo, Ministral, Small     | `[TOOL_CALLS][{...}, ...]`     |
| `phi4_mini_json` | Phi-4-mini                               | `<|tool_call|>{...}<|/tool_call|>` |
| `pythonic`       | Gemma 2, Gemma 3                         | `[f(x=1), g(y="a")]`, tool_code |

`choose` picks one from the checkpoint's chat template, deterministically (the first rule that
matches, in `RULES`' order), or by name (`--tool-call-parser`; vLLM's names).
"""

from __future__ import annotations

from predictor.engine.tool_formats.base import Choice, Delta, Parser, ToolCall, ToolFormat
from predictor.engine.tool_formats.hermes import Hermes
from predictor.engine.tool_formats.llama3 import LLAMA3_JSON
from predictor.engine.tool_formats.mistral import MISTRAL
from predictor.engine.tool_formats.phi4_mini import PHI4_MINI_JSON
from predictor.engine.tool_formats.pythonic import PYTHONIC

__all__ = ["Choice", "Delta", "Parser", "ToolCall", "ToolFormat", "choose", "get", "NAMES"]

HERMES = Hermes()
FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, PHI4_MINI_JSON, PYTHONIC)
}
ALIASES = {
    "qwen": "hermes",
    "qwen3_xml": "hermes",
    "llama4_json": "llama3_json",
    "phi4_mini": "phi4_mini_json",
}
NAMES = tuple(FORMATS)

# (what the template holds, the format): the first match wins; none: hermes
RULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<tool_call>",), "hermes"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|python_tag|>", '"parameters": dictionary of argument name'), "llama3_json"),
    (("<|tool_call|>", "<|tool|>"), "phi4_mini_json"),
    # Gemma's templates show no tools: their turn marker, or a template that shows tool_code
    (("```tool_code", "<start_of_turn>"), "pythonic"),
)


def get(name: str) -> ToolFormat:
    """The format of that parser name (vLLM's names); KeyError for one not served."""
    return FORMATS[ALIASES.get(name, name)]


def detect(template: str | None) -> str:
    """The parser name a chat template's text asks for."""
    text = template or ""
    for markers, name in RULES:
        if any(marker in text for marker in markers):
            return name
    return "hermes"


def choose(template: str | None, override: str | None = None) -> ToolFormat:
    """The format of `override` where given, else the one the template asks for."""
    return get(override) if override else get(detect(template))
