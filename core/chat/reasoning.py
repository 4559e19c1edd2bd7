"""Reasoning apart from the answer: a `<think>...</think>` block (Qwen3, DeepSeek-R1 and its
distills) or gpt-oss's `analysis` channel becomes `reasoning_content` (vLLM's field) in the
server and goes to stderr in `zoo run` / `zoo chat`.

A think block may be opened by the chat template itself (DeepSeek-R1's generation prompt ends
with `<think>\\n`; so does Qwen3's when thinking is on): the answer then starts inside it.
"""

from __future__ import annotations

import json
from typing import Any

OPEN, CLOSE = "<think>", "</think>"


def thinks(tok: Any) -> bool:
    """Whether a model writes think blocks: its template or vocabulary knows `</think>`."""
    template = (tok and tok.chat_template) or ""
    return tok is not None and (CLOSE in template or tok.token_to_id(CLOSE) is not None)


class ThinkSplitter:
    """Splits streamed text into (reasoning, content) pieces at `<think>` / `</think>`, holding
    back a tail that may be the start of a tag."""

    def __init__(self, opened: bool = False):
        self.thinking = opened  # the prompt opened the block
        self.started = opened  # (a block opens only at the start of an answer)
        self.tail = ""
        self.trim = opened  # newlines right after a tag are the tag's, not the text's

    def feed(self, piece: str) -> tuple[str, str]:
        text, reasoning, content = self.tail + piece, "", ""
        self.tail = ""
        while text:
            if not self.started:
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    self.started = self.thinking = self.trim = True
                    text = stripped[len(OPEN) :]
                    continue
                if OPEN.startswith(stripped):  # may still become "<think>"
                    self.tail = text
                    return reasoning, content
                self.started = True
            tag = CLOSE if self.thinking else None
            if tag and tag in text:
                before, text = text.split(tag, 1)
                reasoning += before.lstrip("\n") if self.trim else before
                self.thinking, self.trim = False, True
                continue
            keep = max(
                (k for k in range(1, len(CLOSE)) if tag and text.endswith(CLOSE[:k])), default=0
            )
            out, self.tail = text[: len(text) - keep], text[len(text) - keep :]
            if self.trim:
                out = out.lstrip("\n")
                self.trim = not out
            if self.thinking:
                reasoning += out
            else:
                content += out
            break
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is still held back, at the end of the answer."""
        tail, self.tail = self.tail, ""
        return (tail, "") if self.thinking else ("", tail)


def split(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole answer."""
    s = ThinkSplitter(opened)
    r1, c1 = s.feed(text)
    r2, c2 = s.flush()
    return (r1 + r2).strip(), c1 + c2


class Reasoner:
    """How one chat request's answer carries its reasoning: gpt-oss's harmony channels, or a
    think block (which the generation prompt may have opened); `reader` reads it."""

    def __init__(self, tok: Any, prompt: list[int], harmony: bool):
        tail = tok.decode(prompt[-16:], skip_special_tokens=False).rstrip()
        self.opened = tail.endswith(OPEN)  # the generation prompt opened the block
        self.harmony = harmony

    @classmethod
    def for_request(cls, tok: Any, prompt: list[int]) -> Reasoner | None:
        from core.chat.harmony import is_harmony

        harmony = is_harmony(tok)
        return cls(tok, prompt, harmony) if harmony or thinks(tok) else None

    def params(self) -> dict:
        """What decoding the answer needs: harmony's channels are special tokens, kept in the
        text for core.chat.harmony.HarmonyReader."""
        return {"skip_special_tokens": False} if self.harmony else {}


class Reader:
    """One answer read as it streams into deltas (core.chat.tool_formats.call_stream.Delta): its
    thinking apart, then the rest as content or, with a tool-call reader, as content and calls."""

    def __init__(self, think: ThinkSplitter | None, calls: Any = None):
        self.think, self.reader = think, calls
        self.calls = calls.calls if calls else []

    def feed(self, piece: str) -> list:
        thought, text = self.think.feed(piece) if self.think else ("", piece)
        return self._out(thought, text)

    def finish(self) -> list:
        thought, text = self.think.flush() if self.think else ("", "")
        out = self._out(thought, text)
        return out + self.reader.finish() if self.reader else out

    def complete(self) -> bool:
        return self.reader.complete() if self.reader else False

    def _out(self, thought: str, text: str) -> list:
        out = [("reasoning", thought, None)] if thought else []
        if text:
            out += self.reader.feed(text) if self.reader else [("content", text, None)]
        return out


def reader(reasoner: Reasoner | None, tools: Any = None) -> Any:
    """A fresh reader of one answer (a choice) of a chat request: a harmony answer's channels,
    or a think block; and, with `tools` (a core.chat.tool_calls.ToolUse), the calls."""
    if tools is not None and tools.forced:  # the answer is the call's JSON from its start
        return Reader(None, tools.stream())
    if reasoner is not None and reasoner.harmony:
        from core.chat.harmony import HarmonyReader

        return HarmonyReader(tools=tools is not None)
    think = ThinkSplitter(reasoner.opened) if reasoner is not None else None
    return Reader(think, tools and tools.stream())


def read_whole(rd: Any, text: str, cut: bool = False) -> tuple[str, list[tuple[str, str]], str]:
    """(content, calls as (name, arguments' text), reasoning) of a whole answer, as the deltas
    of its stream join. Calls that are not whole leave their text as content; but in an answer
    `cut` short (by max_tokens) the calls written whole before the cut are kept, and the one
    being written is dropped (its pieces were streamed; finish_reason "length" says so)."""
    deltas = rd.feed(text) + rd.finish()
    content = "".join(t for kind, t, _ in deltas if kind == "content")
    calls = [(name, args) for name, args in rd.calls]
    if cut:
        calls = [(name, args) for name, args in calls if _is_object(args)]
    elif calls and not rd.complete():
        content, calls = rd.reader.text, []  # (all the text the call reader was fed)
    return content, calls, "".join(t for kind, t, _ in deltas if kind == "reasoning").strip()


def _is_object(text: str) -> bool:
    """Whether a call's arguments are whole: a JSON object."""
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False
