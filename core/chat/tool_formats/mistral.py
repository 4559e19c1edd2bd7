"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v0.3), or (v11+)
`[TOOL_CALLS]name[ARGS]{...}`, each call after its own `[TOOL_CALLS]`."""

from __future__ import annotations

import secrets
import string

from core.chat.tool_formats.call_stream import CallStream, listed

NAME = "mistral"
CALLS = "[TOOL_CALLS]"


def detect(chat_template: str) -> bool:
    """Whether a chat template writes `[TOOL_CALLS]`."""
    return CALLS in chat_template


def call_id() -> str:
    """9 letters and digits: Mistral's templates accept no other id (as vLLM writes them)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def grammar(s: CallStream):
    """Content, then the calls after `[TOOL_CALLS]`: one JSON list, or each `name[ARGS]{...}`."""
    if not (yield from s.content_until(CALLS)):
        return
    yield from s.ws()
    if (yield from s.at("[")):  # v0.3: one JSON list
        yield from listed(s)
        return
    while True:  # v11+: name[ARGS]{...}, each after its own [TOOL_CALLS]
        s.head((yield from s.upto("[ARGS]")).strip())
        yield from s.arguments()
        yield from s.ws()
        if not (yield from s.at(CALLS)):
            return
        s.i += len(CALLS)
