"""The core's tool-call formats (core/chat/tool_formats/), registered through the same hook as a
plugin's."""

from core.chat.tool_formats import BUILTIN
from core.hookspecs import hookimpl


@hookimpl
def zoo_register_tool_formats(registry):
    for family in BUILTIN:
        registry.add_tool_format(family.NAME, family.detect, family.grammar, family.call_id)
