"""The schemas forced tool calls are held to: a function's parameters closed as OpenAI's strict
function calling closes them (an object names all the properties it may have), so that a forced
call's arguments always fit `fn(**arguments)`; and the answer shapes of `tool_choice` "required"
and of the generic format (core/chat/tool_formats/generic.py).
"""

from __future__ import annotations

import json
from typing import Any

NO_ARGUMENTS = {"type": "object", "properties": {}}  # a function declared without parameters
# keywords whose value is one subschema / a list of them / a {name: subschema} map
ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
ONE += ("additionalProperties", "unevaluatedItems", "unevaluatedProperties")
MANY = ("prefixItems", "anyOf", "oneOf")
MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """A copy of a JSON schema in which every object that does not say `additionalProperties`
    takes only the properties it declares (none if it declares none); objects that do say it
    (`true`, a schema) keep their word. Required properties stay required. The members of an
    `allOf` are not closed themselves (each would refuse the others' properties); their nested
    objects are."""
    return _close(json.loads(json.dumps(schema)))  # (a copy without shared parts)


def _close(s: Any) -> Any:
    if not isinstance(s, dict):
        return s
    for key in ONE:
        if isinstance(s.get(key), dict):
            s[key] = _close(s[key])
    for key in (*MANY, "items"):  # ("items" as a list: draft 4's tuples)
        if isinstance(s.get(key), list):
            s[key] = [_close(x) for x in s[key]]
    for key in MAP:
        if isinstance(s.get(key), dict):
            s[key] = {k: _close(v) for k, v in s[key].items()}
    if isinstance(s.get("allOf"), list):
        s["allOf"] = [_open_members(x) for x in s["allOf"]]
    if _is_object(s) and "additionalProperties" not in s:
        s["additionalProperties"] = False
    return s


def _open_members(s: Any) -> Any:
    """An allOf member: its nested objects closed, itself left as written."""
    if not isinstance(s, dict):
        return s
    had = "additionalProperties" in s
    s = _close(s)
    if not had:
        s.pop("additionalProperties", None)
    return s


def _is_object(s: dict) -> bool:
    t = s.get("type")
    if t is None:
        return "properties" in s
    return t == "object" or (isinstance(t, list) and "object" in t)


def parameters(tool: dict) -> dict:
    """The schema a forced call's arguments must match: the function's parameters closed (or
    as written, JSON Schema's meaning, when the function says `strict: false`)."""
    given = tool.get("parameters") or NO_ARGUMENTS
    return given if tool.get("strict") is False else closed(given)


def calls_schema(tools: list[dict], parallel: bool, key: str = "parameters") -> dict:
    """A JSON list of at least one {"name": ..., key: arguments} (exactly one when not
    `parallel`), each call's arguments by its function's `parameters`."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t["name"]]}, key: parameters(t)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    return calls if parallel else {**calls, "maxItems": 1}
