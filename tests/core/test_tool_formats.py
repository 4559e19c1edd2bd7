"""Tool-call formats come from plugins: the built-in families are registered through
`zoo_register_tool_formats` like a third party's, a plugin package's format is then the one a
chat template that teaches it is read by (before the built-ins), and claims are checked."""

from __future__ import annotations

import json

import pytest
from test_plugin_loading import run_py, write_dist

from core import PluginError
from core.chat.tool_calls import call_id, family, formats, parse
from core.chat.tool_formats import BUILTIN, GRAMMARS, hermes
from core.plugins import Registry, describe_plugins

# A third-party format: `<<CALL>>name {...}`, each call after its own marker; its ids its own.
PIPE_PLUGIN = """
    from core.hookspecs import hookimpl

    MARK = "<<CALL>>"

    def detect(chat_template):
        return MARK in chat_template

    def grammar(s):
        if not (yield from s.content_until(MARK)):
            return
        while True:
            s.head((yield from s.upto(" ")).strip())
            yield from s.arguments()
            yield from s.ws()
            if not (yield from s.at(MARK)):
                return
            s.i += len(MARK)

    @hookimpl
    def zoo_register_tool_formats(registry):
        registry.add_tool_format("pipe", detect, grammar, call_id=lambda: "pipe-1")
"""

USE = """
import json
from core.chat.tool_calls import ToolUse, call_id, family, parse
from core.plugins import describe_plugins

template = "{{ '<<CALL>>' }} or, says its help text, <tool_call>"  # Hermes' marker too
fam = family(template)
text = 'Checking. <<CALL>>get_time {"zone": "CET"} <<CALL>>get_weather {"city": "Paris"}'
stream = ToolUse([{"name": "get_time"}], "auto", fam).stream()
deltas = [d for piece in (text[:20], text[20:41], text[41:]) for d in stream.feed(piece)]
print(json.dumps({
    "family": fam,
    "parsed": parse(fam, text),
    "deltas": deltas + stream.finish(),
    "id": call_id(fam),
    "registers": {r["name"]: r["registers"] for r in describe_plugins()},
}))
"""


def test_a_plugin_package_adds_a_format_that_is_used(tmp_path):
    write_dist(tmp_path, "zoo-pipe", "zoo_pipe", PIPE_PLUGIN)
    out = run_py(tmp_path, USE)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["family"] == "pipe"  # asked before Hermes, whose marker the template also holds
    calls = [
        {"name": "get_time", "arguments": {"zone": "CET"}},
        {"name": "get_weather", "arguments": {"city": "Paris"}},
    ]
    assert got["parsed"] == ["Checking.", calls]
    deltas = [tuple(d) for d in got["deltas"]]
    assert deltas[:2] == [("content", "Checking.", None), ("call", "get_time", 0)]
    assert ("call", "get_weather", 1) in deltas
    args = "".join(t for kind, t, k in deltas if kind == "args" and k == 0)
    assert args == '{"zone": "CET"}'
    assert got["id"] == "pipe-1"
    assert got["registers"]["zoo-pipe:zoo_pipe"] == {"tool_formats": ["pipe"]}


def test_the_builtin_families_come_through_the_hook():
    rows = {row["name"]: row for row in describe_plugins()}
    names = [family.NAME for family in BUILTIN]
    assert rows["plugins.tool_formats"]["registers"] == {"tool_formats": names}
    assert [f.name for f in formats() if f.plugin == "plugins.tool_formats"] == names
    assert list(GRAMMARS) == names
    assert family(None) == family("no tools here") == hermes.NAME
    assert parse("hermes", "no call") == ("no call", [])
    assert call_id("hermes").startswith("call_") and len(call_id("mistral")) == 9


def test_two_plugins_claiming_one_tool_format_are_named():
    reg = Registry()
    reg.current_plugin = "zoo-a:a"
    reg.add_tool_format("hermes", hermes.detect, hermes.grammar)
    reg.current_plugin = "zoo-b:b"
    with pytest.raises(PluginError, match=r"tool-call format 'hermes' .* 'zoo-a:a' and plugin"):
        reg.add_tool_format("hermes", hermes.detect, hermes.grammar)
    reg.add_tool_format("other", hermes.detect, hermes.grammar)
    reg.forget("zoo-b:b")
    assert list(reg.tool_formats) == ["hermes"]


@pytest.mark.parametrize(
    "args",
    [
        ("", hermes.detect, hermes.grammar),  # no name
        ("x", "<tool_call>", hermes.grammar),  # a marker, not a detect function
        ("x", hermes.detect, None),
        ("x", hermes.detect, hermes.grammar, "call_1"),  # an id, not a function making them
    ],
)
def test_add_tool_format_names_the_plugin(args):
    reg = Registry()
    reg.current_plugin = "zoo-a:a"
    with pytest.raises(PluginError, match=r"plugin 'zoo-a:a': add_tool_format"):
        reg.add_tool_format(*args)
