"""Hermes' tool-call format under its first name (`engine/tool_formats/` holds every format)."""

from predictor.engine.tool_formats.base import Choice, Delta, ToolCall, schemas
from predictor.engine.tool_formats.hermes import (
    ARGUMENTS,
    BEGIN,
    END,
    HEAD,
    SEPARATOR,
    SYSTEM_PROMPT,
    TAIL,
    StreamParser,
    call_text,
    native,
    plain_conversation,
    split,
    structural_tag,
)

__all__ = [
    "ARGUMENTS",
    "BEGIN",
    "END",
    "HEAD",
    "SEPARATOR",
    "SYSTEM_PROMPT",
    "TAIL",
    "Choice",
    "Delta",
    "StreamParser",
    "ToolCall",
    "call_text",
    "native",
    "plain_conversation",
    "schemas",
    "split",
    "structural_tag",
]
