"""gpt-oss's harmony format: which generated text belongs to the `final` channel.

A harmony message is `<|start|>role<|channel|>name<|message|>text<|end|>` (the last one ends
with `<|return|>` or `<|call|>`); the generation prompt stops at `<|start|>assistant`, so the
model writes a channel header first: `analysis` (its reasoning), `commentary` (tool calls) or
`final` (the answer). The markers are special tokens, so a harmony answer is read from text
decoded with them kept (`skip_special_tokens=False`) by `HarmonyReader`, as it streams: by
`zoo serve` (reasoning_content, content, tool calls) and by `zoo run` / `zoo chat` (reasoning
to stderr, the answer to stdout).
"""

from __future__ import annotations

import re
from typing import Any


def is_harmony(tokenizer: Any) -> bool:
    """Whether a tokenizer speaks harmony: its chat template writes `<|channel|>` and its
    vocabulary holds `<|message|>` (gpt-oss)."""
    template = (tokenizer and tokenizer.chat_template) or ""
    return "<|channel|>" in template and tokenizer.token_to_id("<|message|>") is not None


# markers that end a message's text (`<|start|>` too: a message cut off by the next one)
ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>")
MESSAGE = "<|message|>"
CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
RECIPIENT = re.compile(r"\bto=functions\.([A-Za-z0-9_.\-]+)")


class HarmonyReader:
    """Reads a harmony answer as it streams (its text with the markers kept) into deltas, as
    core.chat.tool_formats.call_stream.CallStream does: the analysis channel as reasoning, the
    final channel (and commentary addressed to no one: a preamble) as content, and a commentary
    message addressed `to=functions.NAME` as a tool call whose arguments are the message's text."""

    def __init__(self, tools: bool = True):
        self.tools = tools
        self.header, self.body = "", None  # the header being read; the open message's kind
        self.tail = ""  # text that may be the start of a marker
        self.calls: list[list[str]] = []  # [name, arguments' text so far] per call
        self.opened = False  # whether any message was

    def feed(self, piece: str) -> list[tuple[str, str, int | None]]:
        out: list[tuple[str, str, int | None]] = []
        text, self.tail = self.tail + piece, ""
        while text:
            if self.body is None:  # a header, up to <|message|>
                self.header += text
                cut = self.header.find(MESSAGE)
                if cut < 0:
                    break
                text = self.header[cut + len(MESSAGE) :]
                self.body, self.header, self.opened = self._open(self.header[:cut], out), "", True
                continue
            hits = [(i, m) for m in ENDS if (i := text.find(m)) >= 0]
            if hits:
                cut, marker = min(hits)
                self._text(text[:cut], out)
                text = text[cut + len(marker) :] if marker != "<|start|>" else text[cut:]
                self.body = None
                continue
            keep = text.rfind("<")  # a marker may be starting
            if keep < 0 or not any(m.startswith(text[keep:]) for m in ENDS):
                keep = len(text)
            self._text(text[:keep], out)
            self.tail = text[keep:]
            break
        return out

    def finish(self) -> list[tuple[str, str, int | None]]:
        out = self.feed("")
        if self.body is not None:
            self._text(self.tail, out)
        elif not self.opened and self.header:  # no harmony at all: plain text
            out.append(("content", self.header, None))
        self.tail = ""
        return out

    def complete(self) -> bool:
        return bool(self.calls)

    def _open(self, header: str, out: list) -> str:
        """The kind of the message whose header this is ("" for one that is not shown)."""
        channel = (CHANNEL.search(header) or [None, None])[1]
        to = RECIPIENT.search(header)
        if channel == "analysis":
            return "reasoning"
        if to and self.tools:
            out.append(("call", to[1], len(self.calls)))
            self.calls.append([to[1], ""])
            return "args"
        if channel == "final" or (channel == "commentary" and "to=" not in header):
            return "content"
        return ""

    def _text(self, text: str, out: list) -> None:
        if not text or not self.body:
            return
        k = len(self.calls) - 1 if self.body == "args" else None
        if k is not None:
            self.calls[k][1] += text
        out.append((self.body, text, k))
