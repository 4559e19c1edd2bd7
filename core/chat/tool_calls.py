"""Tool calls: what a model writes when it calls a function, per family, read back into OpenAI's
`tool_calls` as it streams; and the JSON schemas that force a call (`tool_choice` "required" or
a named function), as vLLM forces them.

Each family writes its calls its own way (the chat template tells the model how):
- Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (with
  newlines inside the tags), repeated
- Llama 3.1 / 3.2 / 3.3: the whole answer is `{"name": ..., "parameters": {...}}` (after an
  optional `<|python_tag|>`), several joined by `;`
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or (v11+)
  `[TOOL_CALLS]name[ARGS]{...}`
- DeepSeek V3 / R1: `<｜tool▁calls▁begin｜>`, then per call `<｜tool▁call▁begin｜>function
  <｜tool▁sep｜>name` + a ```json block + `<｜tool▁call▁end｜>` (V3.1: `<｜tool▁call▁begin｜>name
  <｜tool▁sep｜>{...}<｜tool▁call▁end｜>`), then `<｜tool▁calls▁end｜>`
A `CallStream` reads an answer (special tokens kept: some families' markers are special tokens)
piece by piece, as vLLM's tool parsers do: text before a call goes out as content, text that
may still be a call's marker is held back until decided, a call goes out as a head (its name)
once its name is read, then its arguments' JSON text piece by piece as written. Text that turns
out to be no call goes out as content.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Generator
from typing import Any

Call = dict[str, Any]  # {"name": str, "arguments": dict}
# what a reader says, piece by piece: ("content" | "reasoning", text, None), ("call", name, k)
# (call k begins), ("args", text, k) (the next piece of call k's arguments)
Delta = tuple[str, str, int | None]

DS_CALLS, DS_CALL = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"
DS_SEP, DS_END = "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
MISTRAL = "[TOOL_CALLS]"
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # what OpenAI accepts as a function's name


class NoCall(Exception):
    """The text being read is not (or no longer) a well-formed call."""


Grammar = Callable[["CallStream"], Generator[None, None, None]]


class CallStream:
    """Reads one answer as it streams (`feed`, then `finish`) into deltas, by a family's
    grammar: a generator over this reader's helpers that yields whenever it needs more text."""

    def __init__(self, grammar: Grammar):
        self.text, self.i, self.sent = "", 0, 0  # all text fed; the grammar's cursor; content out
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
        """A call begins: its name goes out."""
        if not NAME.fullmatch(name):
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


# --- each family's grammar --------------------------------------------------------------------
def hermes(s: CallStream):
    if not (yield from s.content_until("<tool_call>")):
        return
    while True:
        yield from s.call_object()
        yield from s.ws()
        if (yield from s.at("</tool_call>")):
            s.i += len("</tool_call>")
        yield from s.ws()
        if not (yield from s.at("<tool_call>")):
            return
        s.i += len("<tool_call>")


def llama3(s: CallStream):
    yield from s.ws()
    if (yield from s.at("<|python_tag|>")):
        s.i += len("<|python_tag|>")
        yield from s.ws()
    if not (yield from s.at("{")):
        raise NoCall
    while True:
        yield from s.call_object()
        yield from s.ws()
        if not (yield from s.at(";")):
            return
        s.i += 1


def mistral(s: CallStream):
    if not (yield from s.content_until(MISTRAL)):
        return
    yield from s.ws()
    if (yield from s.at("[")):  # v0.3: one JSON list
        yield from listed(s)
        return
    while True:  # v11+: name[ARGS]{...}, each after its own [TOOL_CALLS]
        s.head((yield from s.upto("[ARGS]")).strip())
        yield from s.arguments()
        yield from s.ws()
        if not (yield from s.at(MISTRAL)):
            return
        s.i += len(MISTRAL)


def deepseek(s: CallStream):
    if not (yield from s.content_until(DS_CALLS)):
        return
    while True:
        yield from s.ws()
        if not (yield from s.at(DS_CALL)):
            return
        s.i += len(DS_CALL)
        name = (yield from s.upto(DS_SEP)).strip()
        if name == "function":  # V3 / R1: the name on its line, then a ```json block
            name = (yield from s.upto("\n")).strip()
            yield from s.upto("```")
            yield from s.upto("\n")
        s.head(name)
        yield from s.arguments()
        yield from s.upto(DS_END)


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


GRAMMARS: dict[str, Grammar] = {
    "hermes": hermes,
    "llama3": llama3,
    "mistral": mistral,
    "deepseek": deepseek,
}


def read(grammar: Grammar, text: str) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments' JSON text)]) of a whole answer; text whose calls are not
    whole (cut short, arguments that are no JSON object) is all content."""
    s = CallStream(grammar)
    deltas = s.feed(text) + s.finish()
    if not s.complete():
        return text, []
    return "".join(t for kind, t, _ in deltas if kind == "content"), [tuple(c) for c in s.calls]


def parse(fam: str, text: str) -> tuple[str, list[Call]]:
    """(content, calls with their arguments parsed) of a whole answer of a family."""
    content, calls = read(GRAMMARS[fam], text)
    return content, [{"name": n, "arguments": json.loads(a)} for n, a in calls]


def family(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches its model (Hermes when it names none)."""
    t = chat_template or ""
    if "tool▁calls▁begin" in t:
        return "deepseek"
    if MISTRAL in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and '"parameters"' in t):
        return "llama3"
    return "hermes"


def call_id(fam: str | None = None) -> str:
    """A call's id; Mistral's templates accept only 9 letters and digits (as vLLM writes them)."""
    if fam == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


class _Arguments(dict):
    """A call's arguments as chat templates take them: an object (`tojson`, `.items()`) that
    becomes its JSON text as written where a template joins it to strings (DeepSeek V3 / R1:
    `'```json' + '\\n' + tool['function']['arguments']`) or prints it."""

    def __init__(self, value: dict, text: str):
        super().__init__(value)
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __add__(self, other: str) -> str:
        return self.text + other

    def __radd__(self, other: str) -> str:
        return other + self.text


def template_arguments(text: str) -> Any:
    """An earlier call's JSON-string arguments as templates take them (JSONDecodeError if
    they are no JSON)."""
    value = json.loads(text)
    return _Arguments(value, text) if isinstance(value, dict) else value


# --- forcing a call ---------------------------------------------------------------------------
def forced_schema(tools: list[dict], choice: str | None, parallel: bool = True) -> dict:
    """The JSON schema an answer must match when a call is forced (as vLLM forces it): a named
    function's arguments alone, or ("required") a list of at least one {name, parameters} (of
    exactly one when not `parallel`)."""
    params = {t["name"]: t.get("parameters") or {"type": "object"} for t in tools}
    if choice is not None:
        return params[choice]
    options = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in params.items()
    ]
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    return calls if parallel else {**calls, "maxItems": 1}


class ToolUse:
    """One chat request's tools: the schema forcing a call (if forced), and the grammar its
    answers are read by (`stream`)."""

    def __init__(self, tools: list[dict], choice: str, fam: str, parallel: bool = True):
        self.tools, self.parallel, self.fam = tools, parallel, fam
        self.named = None if choice in ("auto", "required") else choice
        self.forced = choice != "auto"

    def structure(self) -> dict:
        """SamplingParams fields: the schema forcing a call; for `auto`, special tokens kept
        in the text (some families' markers are special tokens)."""
        schema = forced_schema(self.tools, self.named, self.parallel)
        return {"json_schema": schema} if self.forced else {"skip_special_tokens": False}

    def grammar(self) -> Grammar:
        if self.named:
            return named(self.named)
        return listed if self.forced else GRAMMARS[self.fam]

    def stream(self) -> CallStream:
        return CallStream(self.grammar())
