"""Tool-call formats: what a model writes when it calls a function, one module per family, each
with the same four names: `NAME`, `detect(chat_template)` (whether a template teaches the
format), `grammar` (reads an answer's calls: a generator over a
`call_stream.CallStream`) and `call_id` (a call's id; None: OpenAI's `call_...`).

The built-in families are registered by plugins/tool_formats.py through the
`zoo_register_tool_formats` hook, as a plugin registers its own; core.chat.tool_calls asks the
registry which format a chat template teaches and reads answers by it.
"""

from core.chat.tool_formats import deepseek, generic, hermes, llama3, mistral

# the built-in families, in the order chat templates are matched against them (after plugins')
BUILTIN = (deepseek, mistral, hermes, llama3, generic)  # (generic: never detected)
GRAMMARS = {family.NAME: family.grammar for family in BUILTIN}  # the built-ins' grammars, by name
