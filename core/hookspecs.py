"""Zoo's hook specifications. A plugin is a module (or object) with `@hookimpl` functions named
after these; built-in plugins and the entry points in group `zoo.plugins` register the same way.
Each hook receives the `core.plugins.Registry` and adds to it."""

import pluggy

hookspec = pluggy.HookspecMarker("zoo")
hookimpl = pluggy.HookimplMarker("zoo")


@hookspec
def zoo_register_architectures(registry):
    """Register decoder architectures with `registry.add_architecture(model_types, config,
    weight_map)`: the hub `model_type` values handled, the `core.hfconfig.DecoderConfig`
    subclass that reads their config.json, and the checkpoint-name -> core-parameter map."""


@hookspec
def zoo_register_formats(registry):
    """Register checkpoint formats with `registry.add_format(name, detect, open)`: `detect(path)`
    says whether a path is in this format; `open(path)` returns a `core.checkpoint.Checkpoint`."""
