"""Llama 3.1 / 3.2 / 3.3: the whole answer is `{"name": ..., "parameters": {...}}` (after an
optional `<|python_tag|>`), several joined by `;`."""

from __future__ import annotations

from core.chat.tool_formats.call_stream import CallStream, NoCall

NAME = "llama3"
PYTHON_TAG = "<|python_tag|>"
call_id = None  # OpenAI's ids


def detect(chat_template: str) -> bool:
    """Whether a chat template writes `<|python_tag|>`, or Llama 3 headers and `"parameters"`."""
    t = chat_template
    return PYTHON_TAG in t or ("<|start_header_id|>" in t and '"parameters"' in t)


def grammar(s: CallStream):
    """Calls only at the answer's start (else the whole answer is content)."""
    yield from s.ws()
    if (yield from s.at(PYTHON_TAG)):
        s.i += len(PYTHON_TAG)
        yield from s.ws()
    if not (yield from s.at("{")):
        raise NoCall
    while True:
        yield from s.call_object()
        yield from s.ws()
        if not (yield from s.at(";")):
            return
        s.i += 1
