"""The reader every tool-call format is written against: a `CallStream` reads an answer (special
tokens kept: some families' markers are special tokens) piece by piece, as vLLM's tool parsers
do, by a family's grammar. Text before a call goes out as content, text that may still be a
call's marker is held back until decided, a call goes out as a head (its name) once its name is
read, then its arguments' JSON text piece by piece as written. Text that turns out to be no
call goes out as content.

A grammar is a generator over the stream's helpers (`ws`, `at`, `take`, `upto`,
`content_until`, `head`, `value`, `arguments`, `call_object`) that yields whenever it needs more
text and raises `NoCall` when the text is no call. `listed` and `named` are the grammars of
forced calls, which any family may answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Generator
from typing import Any

# what a reader says, piece by piece: ("content" | "reasoning", text, None), ("call", name, k)
# (call k begins), ("args", text, k) (the next piece of call k's arguments)
Delta = tuple[str, str, int | None]

NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # what OpenAI accepts as a function's name


class NoCall(Exception):
    """The text being read is not (or no longer) a well-formed call."""


Grammar = Callable[["CallStream"], Generator[None, None, None]]


class CallStream:
    """Reads one answer as it streams (`feed`, then `finish`) into deltas, by a family's
    grammar: a generator over this reader's helpers that yields whenever it needs more text."""

    def __init__(self, grammar: Grammar, most: int | None = None):
        self.text, self.i, self.sent = "", 0, 0  # all text fed; the grammar's cursor; content out
        self.most = most  # calls read at most (parallel_tool_calls false: 1); the rest dropped
        self.eof = False
        self.calls: list[list[str]] = []  # [name, arguments' text so far] per call
        self.out: list[Delta] = []
        self.prose = False  # no call (any more): the rest is content
        self._run: Generator | None = grammar(self)

    def feed(self, piece: str) -> list[Delta]:
        self.text += piece
        return self._step()

    def finish(self) -> list[Delta]:
        self.eof = True
        return self._step()

    def complete(self) -> bool:
        """Whether the calls read are whole: each one's arguments a JSON object."""
        return bool(self.calls) and all(isinstance(_json(a), dict) for _, a in self.calls)

    def _step(self) -> list[Delta]:
        if self._run is not None:
            try:
                next(self._run)  # runs until it needs more text
            except StopIteration:  # the calls are over: what follows them is dropped
                self._run = None
            except NoCall:
                self._run, self.prose = None, not self.calls  # (after a call: dropped)
        if self.prose and self.sent < len(self.text):
            self._content(len(self.text))
        out, self.out = self.out, []
        return out

    # --- helpers the grammars use (generators: `yield from` them) --------------------------------
    def _content(self, end: int) -> None:
        if end > self.sent:
            self.out.append(("content", self.text[self.sent : end], None))
            self.sent = end

    def wait(self, n: int = 1) -> Generator:
        """Until n characters past the cursor have arrived (or the answer ended)."""
        while len(self.text) - self.i < n and not self.eof:
            yield

    def ws(self) -> Generator:
        """Skip whitespace."""
        while True:
            while self.i < len(self.text) and self.text[self.i].isspace():
                self.i += 1
            if self.i < len(self.text) or self.eof:
                return
            yield

    def at(self, s: str) -> Generator[None, None, bool]:
        """Whether the text at the cursor starts with `s` (waits until it can tell)."""
        while True:
            got = self.text[self.i : self.i + len(s)]
            if got == s:
                return True
            if not s.startswith(got) or self.eof:
                return False
            yield

    def take(self, s: str) -> Generator:
        """`s` must come next (else: no call)."""
        if not (yield from self.at(s)):
            raise NoCall
        self.i += len(s)

    def upto(self, marker: str) -> Generator[None, None, str]:
        """The text up to `marker` (consumed, marker included)."""
        while (cut := self.text.find(marker, self.i)) < 0:
            if self.eof:
                raise NoCall
            yield
        text, self.i = self.text[self.i : cut], cut + len(marker)
        return text

    def content_until(self, marker: str) -> Generator[None, None, bool]:
        """Content up to `marker` (consumed); False when the answer ends without one. A tail
        that may be the marker's start, and whitespace before it, are held back meanwhile."""
        while (cut := self.text.find(marker, self.i)) < 0:
            if self.eof:
                self._content(len(self.text))
                return False
            end = len(self.text)
            end -= max(
                (k for k in range(1, len(marker)) if self.text.endswith(marker[:k])), default=0
            )
            self._content(len(self.text[:end].rstrip()))
            self.i = self.sent
            yield
        self._content(len(self.text[:cut].rstrip()))
        self.i = cut + len(marker)
        return True

    def head(self, name: str) -> None:
        """A call begins: its name goes out (a call past `most`: the reading ends, the text
        from there on dropped as any text after the calls is)."""
        if not NAME.fullmatch(name) or (self.most is not None and len(self.calls) >= self.most):
            raise NoCall
        self.sent = len(self.text)  # (what lay between the content and the call is no content)
        self.out.append(("call", name, len(self.calls)))
        self.calls.append([name, ""])

    def _args(self, piece: str) -> None:
        if piece:
            self.out.append(("args", piece, len(self.calls) - 1))
            self.calls[-1][1] += piece

    def value(self, stream: bool = False) -> Generator[None, None, str]:
        """One JSON value's text; with `stream`, sent out as the current call's arguments as
        it arrives (not a JSON string: see `arguments`)."""
        yield from self.ws()
        yield from self.wait()
        start = done = self.i
        first = self.text[start : start + 1]
        stream = stream and first != '"'
        depth, quoted, escaped = 0, False, False
        while True:
            end = None
            while self.i < len(self.text):
                c = self.text[self.i]
                if quoted:
                    escaped, quoted = (False, True) if escaped else (c == "\\", c != '"')
                elif c == '"':
                    quoted = True
                elif c in "{[":
                    depth += 1
                elif depth == 0 and (c in "}],;<" or c.isspace()):  # a bare number ends
                    end = self.i
                    break
                elif c in "}]":
                    depth -= 1
                self.i += 1
                if depth == 0 and not quoted and first in '{["':
                    end = self.i
                    break
            if stream:
                self._args(self.text[done : self.i])
                done = self.i
            if end is None and self.eof and depth == 0 and not quoted:
                end = self.i  # a bare number at the very end
            if end is not None:
                if end == start:
                    raise NoCall
                return self.text[start:end]
            if self.eof:
                raise NoCall
            yield

    def arguments(self) -> Generator:
        """The current call's arguments (a JSON value) streamed as they are written (a JSON
        string holding them, as some models write: decoded, sent whole at its end)."""
        raw = yield from self.value(stream=True)
        if raw.startswith('"'):
            args = _json(raw)
            self._args(args if isinstance(args, str) else raw)

    def call_object(self) -> Generator:
        """`{"name": ..., "arguments" | "parameters": {...}}`: the head once the name is read,
        then the arguments as they are written (held until the name, if written first)."""
        yield from self.ws()
        yield from self.take("{")
        name, seen, early = None, False, None
        while True:
            yield from self.ws()
            if (yield from self.at("}")):
                self.i += 1
                break
            key = _json((yield from self.value()))
            yield from self.ws()
            yield from self.take(":")
            if key == "name" and name is None:
                name = _json((yield from self.value()))
                if not isinstance(name, str):
                    raise NoCall
                self.head(name)
                if early is not None:
                    self._args(early)
            elif key in ("arguments", "parameters") and not seen:
                seen = True
                if name is not None:
                    yield from self.arguments()
                else:
                    raw = yield from self.value()
                    decoded = _json(raw) if raw.startswith('"') else None
                    early = decoded if isinstance(decoded, str) else raw
            elif name is None:  # an object that does not start as a call
                raise NoCall
            else:
                yield from self.value()
            yield from self.ws()
            if (yield from self.at(",")):
                self.i += 1
        if name is None:
            raise NoCall
        if not seen:  # no arguments written: none
            self._args("{}")


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None


# --- the grammars of forced calls (Mistral v0.3 writes `listed` too) ---------------------------
def listed(s: CallStream):
    """A JSON list of call objects (Mistral v0.3; "required" forced calls)."""
    yield from s.ws()
    yield from s.take("[")
    while True:
        yield from s.call_object()
        yield from s.ws()
        if not (yield from s.at(",")):
            return
        s.i += 1


def named(name: str) -> Grammar:
    """A call forced by name: the whole answer is its arguments."""

    def grammar(s: CallStream):
        s.head(name)
        yield from s.arguments()

    return grammar
