"""Zoo's hook specifications: every hook a plugin may implement, in one file.

A plugin is a module (or object) with `@hookimpl` functions named after these. Built-in plugins
(`core.plugins.BUILTIN_PLUGINS`) and the entry points in group `zoo.plugins` register the same
way. Each hook receives the `core.plugins.Registry` and adds to it; what it adds is credited to
the plugin, shown by `zoo plugins`, and two plugins claiming one name is a `PluginError`.
Hooks run once per process, the first time anything asks for the registry. docs/plugins.md
documents each one with an example.
"""

import pluggy

hookspec = pluggy.HookspecMarker("zoo")
hookimpl = pluggy.HookimplMarker("zoo")


@hookspec
def zoo_register_architectures(registry):
    """Register decoder architectures: `registry.add_architecture(model_types, config,
    weight_map)`.

    `model_types`: the hub `model_type` value(s) handled; `config`: the `core.hfconfig.
    DecoderConfig` subclass that reads their config.json; `weight_map`: checkpoint module path
    (layer indices as `{}`) -> core module path, `(core path, shard)` or None (skip it).
    """


@hookspec
def zoo_register_formats(registry):
    """Register checkpoint formats: `registry.add_format(name, detect, open)`.

    `detect(path)` says whether a path is in this format; `open(path)` returns a
    `core.checkpoint.Checkpoint`.
    """


@hookspec
def zoo_register_layers(registry):
    """Register layer kinds: `registry.add_layer(spec_type, module)`.

    The core's generic block builds every module from the type of its spec in the
    `RuntimeConfig` (attention, mlp, norm, embedding); `module` is the `nn.Module` class for
    `spec_type`, or a "package.module:Class" string imported only when a model is built.
    """


@hookspec
def zoo_register_models(registry):
    """Register named models: `registry.add_model(name, *, repo=None, revision="main",
    package=None, file=None, architecture, dtype, params, notes)`.

    A name then works like one from registry.yaml (`load_model(name)`, `zoo run name`,
    `zoo list`): a hub `repo` at `revision`, or a `file` inside the pip `package`.
    """


@hookspec
def zoo_register_tool_formats(registry):
    """Register tool-call formats: `registry.add_tool_format(name, detect, grammar,
    call_id=None)`.

    `detect(chat_template)` says whether a chat template teaches the format (a plugin's formats
    are asked before the built-ins); `grammar` reads an answer's calls, a generator over a
    `core.chat.tool_formats.call_stream.CallStream`; `call_id()` makes a call's id (None:
    OpenAI's `call_...`).
    """
