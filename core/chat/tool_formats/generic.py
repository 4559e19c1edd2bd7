"""Generic: the form of chat templates that cannot show tools (SmolLM2's, a template without a
`tools` variable), as llama.cpp's generic tool-call format. The tools are described in a system
message with the JSON shape to answer with; the model calls them by answering only
`{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`. Earlier calls go back to the template
as that JSON (the assistant's content), the tools' results as a user message of
`{"tool_response": {...}}` lines. No template is detected as this format: the server chooses it
when rendering with and without the tools gives the same prompt."""

from __future__ import annotations

import json
from typing import Any

from core.chat.tool_formats.call_stream import CallStream, listed
from core.chat.tool_schema import calls_schema

NAME = "generic"
KEY = '"tool_calls"'
call_id = None  # OpenAI's ids
SHAPE = '{"tool_calls": [{"name": "<the tool\'s name>", "arguments": {<its arguments>}}]}'


def detect(chat_template: str) -> bool:
    """Never from a template's text (see the module's docstring)."""
    return False


def grammar(s: CallStream):
    """The whole answer is `{"tool_calls": [call, ...]}`, or it is content."""
    yield from s.ws()
    yield from s.take("{")
    yield from s.ws()
    yield from s.take(KEY)
    yield from s.ws()
    yield from s.take(":")
    yield from listed(s)


def forced(tools: list[dict], parallel: bool) -> dict:
    """The schema of a `required` answer in this form (exactly one call when not `parallel`)."""
    calls = calls_schema(tools, parallel, key="arguments")
    return {
        "type": "object",
        "properties": {"tool_calls": calls},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }


def prompt(tools: list[dict]) -> str:
    """The system message's block describing the tools (OpenAI's function objects)."""
    keys = ("name", "description", "parameters")
    lines = [json.dumps({k: t[k] for k in keys if k in t}, ensure_ascii=False) for t in tools]
    return (
        "You can call these tools (each with the JSON schema of its arguments):\n"
        + "\n".join(lines)
        + "\n\nTo call tools, answer with only this JSON object and nothing else:\n"
        + SHAPE
        + '\nThe results come back as {"tool_response": ...}. Otherwise answer in plain text.'
    )


def conversation(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Chat messages (as templates take them) with the tools in the system message, earlier
    calls as the assistant's JSON content, and results as user messages."""
    out: list[dict] = []
    block = prompt(tools)
    if messages and messages[0].get("role") == "system":
        first, *rest = messages
        out.append({**first, "content": f"{first.get('content') or ''}\n\n{block}".lstrip()})
    else:
        out.append({"role": "system", "content": block})
        rest = messages
    results = None  # the user message holding this turn's results (one for all of them)
    for m in rest:
        if m.get("role") == "tool":
            line = json.dumps({"tool_response": _result(m)}, ensure_ascii=False)
            if results is None:
                results = {"role": "user", "content": line}
                out.append(results)
            else:
                results["content"] += "\n" + line
            continue
        results = None
        calls = m.get("role") == "assistant" and m.get("tool_calls")
        out.append(_calls_as_content(m) if calls else m)
    return out


def _calls_as_content(m: dict) -> dict:
    calls = []
    for c in m["tool_calls"]:
        f = c.get("function", {}) if isinstance(c, dict) else {}
        args = f.get("arguments", {})
        calls.append({"name": f.get("name"), "arguments": _as_json(args)})
    text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
    before = m.get("content")
    content = f"{before}\n{text}" if isinstance(before, str) and before else text
    return {k: v for k, v in m.items() if k != "tool_calls"} | {"content": content}


def _result(m: dict) -> dict[str, Any]:
    out = {k: m[k] for k in ("tool_call_id", "name") if m.get(k)}
    out["content"] = _as_json(m.get("content"))
    return out


def _as_json(value: Any) -> Any:
    """A JSON text as its value (arguments, a result written as JSON); anything else as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value
