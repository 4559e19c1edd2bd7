"""Tool calls: what a model writes when it calls a function, per family, back into OpenAI's
`tool_calls`; and the JSON schemas that force a call (`tool_choice` "required" or a named
function), as vLLM forces them.

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
Parsers read the answer with its special tokens kept (the markers are special tokens in some
families) and return (content before the calls, calls); text that is not a well-formed call
stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

Call = dict[str, Any]  # {"name": str, "arguments": dict}

DS_CALLS = "<｜tool▁calls▁begin｜>"
DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)
DS_FENCED = re.compile(r"\s*([^\n]+)\n```(?:json)?\n(.*?)\n?```\s*$", re.S)
HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
MISTRAL = "[TOOL_CALLS]"


def _call(obj: Any) -> Call | None:
    """{"name", "arguments" | "parameters"} -> a Call, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return {"name": obj["name"], "arguments": args} if isinstance(args, dict) else None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _all(objs: list[Any]) -> list[Call] | None:
    calls = [_call(o) for o in objs]
    return calls if calls and all(calls) else None


def parse_hermes(text: str) -> tuple[str, list[Call]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = _all([_json(body) for body in HERMES.findall(text[start:])])
    return (text[:start].strip(), calls) if calls else (text, [])


def parse_llama3(text: str) -> tuple[str, list[Call]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    whole = _json(body)
    parts = [whole] if whole is not None else [_json(p) for p in body.split(";")]
    calls = _all(parts)
    return ("", calls) if calls else (text, [])


def parse_mistral(text: str) -> tuple[str, list[Call]]:
    start = text.find(MISTRAL)
    if start < 0:
        return text, []
    body = text[start + len(MISTRAL) :].strip()
    if body.startswith("["):  # v0.3: one JSON list
        listed = _json(body)
        calls = _all(listed) if isinstance(listed, list) else None
    else:  # v11+: name[ARGS]{...}, each after its own [TOOL_CALLS]
        pieces = [p.split("[ARGS]", 1) for p in body.split(MISTRAL)]
        ok = all(len(p) == 2 for p in pieces)
        calls = _all(
            [{"name": p[0].strip(), "arguments": _json(p[1])} for p in pieces] if ok else []
        )
    return (text[:start].strip(), calls) if calls else (text, [])


def parse_deepseek(text: str) -> tuple[str, list[Call]]:
    start = text.find(DS_CALLS)
    if start < 0:
        return text, []
    objs = []
    for kind, rest in DS_CALL.findall(text[start:]):
        fenced = DS_FENCED.match(rest) if kind.strip() == "function" else None
        if fenced:  # V3 / R1: the name, then the arguments in a ```json block
            objs.append({"name": fenced[1].strip(), "arguments": _json(fenced[2])})
        else:  # V3.1: the name before the separator
            objs.append({"name": kind.strip(), "arguments": _json(rest)})
    calls = _all(objs)
    return (text[:start].strip(), calls) if calls else (text, [])


PARSERS: dict[str, Callable[[str], tuple[str, list[Call]]]] = {
    "hermes": parse_hermes,
    "llama3": parse_llama3,
    "mistral": parse_mistral,
    "deepseek": parse_deepseek,
}
# where a family's calls may start, in text without special tokens (for streaming: text from
# there on is held back until the answer ends); "^": only at the answer's start
STARTS = {
    "hermes": ("<tool_call>",),
    "llama3": ("^{",),
    "mistral": ("^[", MISTRAL),
    "deepseek": (DS_CALLS,),
}


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


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_calls(calls: list[Call]) -> list[dict]:
    """Calls as OpenAI's message.tool_calls (arguments as a JSON string)."""
    return [
        {
            "id": call_id(),
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
        }
        for c in calls
    ]


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


def forced_calls(text: str, choice: str | None) -> list[Call]:
    """The calls of an answer written under `forced_schema` (empty if cut short)."""
    value = _json(text)
    if choice is not None:
        return [{"name": choice, "arguments": value}] if isinstance(value, dict) else []
    return (_all(value) or []) if isinstance(value, list) else []


class HoldBack:
    """Streams an answer's text but holds it back from where a tool call may start (a family's
    marker, or a character the answer may start a call with); `held` is what was kept."""

    def __init__(self, fam: str | None):
        """fam None: hold everything (a forced call is JSON from its first character)."""
        starts = STARTS[fam] if fam else ()
        self.anywhere = [m for m in starts if not m.startswith("^")]
        self.first = [m[1:] for m in starts if m.startswith("^")]
        self.sent, self.held, self.holding = "", "", fam is None

    def feed(self, piece: str) -> str:
        """Text that may go out now."""
        if self.holding:
            self.held += piece
            return ""
        text = self.held + piece
        if not self.sent.strip() and any(text.lstrip().startswith(m) for m in self.first):
            self.held, self.holding = text, True
            return ""
        for m in self.anywhere:
            if m in text:
                cut = text.index(m)
                self.held, self.holding = text[cut:], True
                self.sent += text[:cut]
                return text[:cut]
        # keep back a tail that may be the start of a marker
        keep = max(
            (k for m in self.anywhere for k in range(1, len(m)) if text.endswith(m[:k])), default=0
        )
        out, self.held = text[: len(text) - keep], text[len(text) - keep :]
        self.sent += out
        return out


class ToolUse:
    """One chat request's tools: the schema forcing a call (if forced), and how its answers are
    streamed (held back from a possible call on) and read back into tool_calls."""

    def __init__(
        self,
        tools: list[dict],
        choice: str,
        fam: str,
        decode: Callable,
        stops: set,
        parallel: bool = True,
    ):
        self.tools, self.parallel = tools, parallel
        self.named = None if choice in ("auto", "required") else choice
        self.forced = choice != "auto"
        self.fam, self.decode, self.stops = fam, decode, stops

    def structure(self) -> dict:
        """SamplingParams fields that force the call."""
        schema = forced_schema(self.tools, self.named, self.parallel)
        return {"json_schema": schema} if self.forced else {}

    def hold(self) -> HoldBack:
        return HoldBack(None if self.forced else self.fam)

    def answer(self, result) -> tuple[str | None, list[dict] | None]:
        """(content, tool_calls or None) of a GenerationResult."""
        if self.forced:
            calls = forced_calls(result.text, self.named)
            return (None, openai_calls(calls)) if calls else (result.text, None)
        ids = result.token_ids
        if ids and ids[-1] in self.stops:
            ids = ids[:-1]
        content, calls = PARSERS[self.fam](self.decode(ids))
        if not calls:
            return result.text, None
        return content or None, openai_calls(calls)
