"""Reasoning apart from the answer: a `<think>...</think>` block (Qwen3, DeepSeek-R1 and its
distills) or gpt-oss's `analysis` channel becomes `reasoning_content` (vLLM's field) in the
server and goes to stderr in `zoo run` / `zoo chat`.

A think block may be opened by the chat template itself (DeepSeek-R1's generation prompt ends
with `<think>\\n`; so does Qwen3's when thinking is on): the answer then starts inside it.
"""

from __future__ import annotations

import re
from typing import Any

OPEN, CLOSE = "<think>", "</think>"
# a harmony message: <|channel|>name ...<|message|>text, up to the next marker or the end
HARMONY = re.compile(
    r"<\|channel\|>(\w+)[^<]*<\|message\|>(.*?)(?=<\|(?:end|return|call|start)\|>|$)", re.S
)


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


def split_harmony(raw: str) -> tuple[str, str]:
    """(analysis, final) of a harmony answer decoded with its special tokens."""
    parts: dict[str, list[str]] = {}
    for channel, text in HARMONY.findall(raw):
        parts.setdefault(channel, []).append(text)
    return "".join(parts.get("analysis", [])), "".join(parts.get("final", []))


class Reasoner:
    """One request's reasoning split: whole answers (`answer`) and streams (`stream`)."""

    def __init__(self, tok: Any, prompt: list[int], harmony: bool):
        tail = tok.decode(prompt[-16:], skip_special_tokens=False).rstrip()
        self.opened = tail.endswith(OPEN)  # the generation prompt opened the block
        self.harmony, self.tok = harmony, tok

    @classmethod
    def for_request(cls, tok: Any, prompt: list[int]) -> Reasoner | None:
        from core.harmony import FinalChannel

        harmony = FinalChannel.for_tokenizer(tok) is not None
        return cls(tok, prompt, harmony) if harmony or thinks(tok) else None

    def answer(self, result: Any, text: str) -> tuple[str, str]:
        """(reasoning, content) of a finished answer whose visible text is `text`."""
        if self.harmony:  # the channels are special tokens: read them from the raw answer
            return split_harmony(self.tok.decode(result.token_ids, skip_special_tokens=False))
        return split(text, self.opened)

    def stream(self) -> ThinkSplitter | None:
        """A splitter for streamed text; None for harmony (its split waits for the end)."""
        return None if self.harmony else ThinkSplitter(self.opened)
