"""gpt-oss's harmony format: which generated text belongs to the `final` channel.

A harmony message is `<|start|>role<|channel|>name<|message|>text<|end|>` (the last one ends
with `<|return|>` or `<|call|>`); the generation prompt stops at `<|start|>assistant`, so the
model writes a channel header first: `analysis` (its reasoning), `commentary` (tool calls) or
`final` (the answer). `zoo run` / `zoo chat` print the final channel only.
"""

from __future__ import annotations

import re
from typing import Any

HEADER_TOKENS = ("<|start|>", "<|end|>", "<|return|>", "<|call|>")


class FinalChannel:
    """Follows a generation token by token (`on_token`, before each token's text is yielded)
    and says whether the text the last token made belongs to the final channel (`show`)."""

    def __init__(self, tokenizer: Any, channel: int, message: int, header: set[int]):
        self._tok, self._channel, self._message, self._header = tokenizer, channel, message, header
        self._name: list[int] | None = None  # a channel name's ids, while one is being read
        self.show = False  # nothing before the first channel header is the answer
        self.channel: str | None = None  # the channel the last token's text belongs to

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> FinalChannel | None:
        """A filter for a harmony-format tokenizer (its template writes `<|channel|>` and the
        vocabulary holds the markers); None for any other."""
        template = (tokenizer and tokenizer.chat_template) or ""
        channel = tokenizer.token_to_id("<|channel|>") if "<|channel|>" in template else None
        message = tokenizer.token_to_id("<|message|>") if channel is not None else None
        if message is None:
            return None
        header = {tokenizer.token_to_id(t) for t in HEADER_TOKENS} - {None}
        return cls(tokenizer, channel, message, header)

    def on_token(self, row: int, token: int, logprob: Any = None) -> None:
        if token == self._channel:
            self._name, self.show = [], False
        elif token == self._message:
            words = self._tok.decode(self._name or []).split()  # "final", "commentary to=..."
            self.channel = words[0] if words else None
            self._name, self.show = None, self.channel == "final"
        elif token in self._header:
            self._name, self.show, self.channel = None, False, None
        elif self._name is not None:
            self._name.append(token)


# markers that end a message's text (`<|start|>` too: a message cut off by the next one)
ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>")
MESSAGE = "<|message|>"
CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
RECIPIENT = re.compile(r"\bto=functions\.([A-Za-z0-9_.\-]+)")


class HarmonyReader:
    """Reads a harmony answer as it streams (its text with the markers kept) into deltas, as
    core.tool_calls.CallStream does: the analysis channel as reasoning, the final channel (and
    commentary addressed to no one: a preamble) as content, and a commentary message addressed
    `to=functions.NAME` as a tool call whose arguments are the message's text."""

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
