"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): its bodies
(`bodies.py`), a body -> the same engine request the chat path builds (`requests.py`), and the
engine's answer -> Anthropic's message, stream events and errors (`responses.py`)."""
