"""Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (with
newlines inside the tags), repeated. Also the format of templates that name none."""

from __future__ import annotations

from core.chat.tool_formats.call_stream import CallStream

NAME = "hermes"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
call_id = None  # OpenAI's ids


def detect(chat_template: str) -> bool:
    """Whether a chat template writes `<tool_call>`."""
    return OPEN in chat_template


def grammar(s: CallStream):
    """Content, then calls, each in its `<tool_call>` tags."""
    if not (yield from s.content_until(OPEN)):
        return
    while True:
        yield from s.call_object()
        yield from s.ws()
        if (yield from s.at(CLOSE)):
            s.i += len(CLOSE)
        yield from s.ws()
        if not (yield from s.at(OPEN)):
            return
        s.i += len(OPEN)
