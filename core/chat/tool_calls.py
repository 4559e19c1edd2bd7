"""Tool calls in OpenAI's shape: which format a chat template teaches (the formats registered
through `zoo_register_tool_formats`: the built-in families of core/chat/tool_formats/ and any
plugin's), answers read back into `tool_calls` by that format's grammar, call ids, earlier calls'
arguments as chat templates take them, and the JSON schemas that force a call (`tool_choice`
"required" or a named function), as vLLM forces them.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from core.chat.tool_formats import generic
from core.chat.tool_formats.call_stream import CallStream, Grammar, listed, named
from core.chat.tool_schema import calls_schema, parameters
from core.plugins import BUILTIN_PLUGINS, ToolFormat, registry

Call = dict[str, Any]  # {"name": str, "arguments": dict}
FALLBACK = "hermes"  # the format of templates that name none


def formats() -> list[ToolFormat]:
    """The registered tool-call formats in the order chat templates are matched: plugins' own
    first (one may claim a template a built-in would also take), then the built-ins."""
    return sorted(registry().tool_formats.values(), key=lambda f: f.plugin in BUILTIN_PLUGINS)


def tool_format(name: str) -> ToolFormat:
    """The registered format called `name` (as `family` names them)."""
    return registry().tool_formats[name]


def family(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches its model (Hermes when it names none)."""
    return detected(chat_template) or FALLBACK


def detected(chat_template: str | None) -> str | None:
    """The tool-call format a chat template names, or None."""
    t = chat_template or ""
    return next((f.name for f in formats() if f.detect(t)), None)


def call_id(fam: str | None = None) -> str:
    """A call's id, as its format makes them (Mistral's templates accept only 9 letters and
    digits); OpenAI's `call_...` otherwise."""
    fmt = registry().tool_formats.get(fam) if fam else None
    if fmt is not None and fmt.call_id is not None:
        return fmt.call_id()
    return f"call_{uuid.uuid4().hex[:24]}"


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
    content, calls = read(tool_format(fam).grammar, text)
    return content, [{"name": n, "arguments": json.loads(a)} for n, a in calls]


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
    exactly one when not `parallel`); arguments closed as OpenAI's strict mode closes them
    (core/chat/tool_schema.py)."""
    if choice is not None:
        return parameters(next(t for t in tools if t["name"] == choice))
    return calls_schema(tools, parallel)


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
        if self.fam == generic.NAME and not self.named:  # the form its prompt asks for
            schema = generic.forced(self.tools, self.parallel)
        else:
            schema = forced_schema(self.tools, self.named, self.parallel)
        return {"json_schema": schema} if self.forced else {"skip_special_tokens": False}

    def grammar(self) -> Grammar:
        if self.named:
            return named(self.named)
        if self.forced and self.fam != generic.NAME:
            return listed
        return tool_format(self.fam).grammar

    def stream(self) -> CallStream:
        """A reader of one answer (one call at most when calls are not parallel)."""
        return CallStream(self.grammar(), most=None if self.parallel else 1)
