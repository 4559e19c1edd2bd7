"""The plugin manager and the registry plugins fill.

Built-in plugins (`BUILTIN_PLUGINS`) and every entry point in group `zoo.plugins` are registered
through one path, `_register`, then `check_pending()` catches hook implementations whose names
match no spec. Plugins are loaded once per process, on first use.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path
from typing import Any

import pluggy

from core import hookspecs
from core.errors import CheckpointError, ConfigError, PluginError

log = logging.getLogger("zoo")

ENTRY_POINT_GROUP = "zoo.plugins"
BUILTIN_PLUGINS = (
    "plugins.llama3",
    "plugins.qwen2",
    "plugins.deepseek",
    "plugins.safetensors",
    "plugins.gguf",
)

# checkpoint module path (integers as "{}") -> core module path, or (core path, shard name),
# or None to skip the tensor. Anything not listed maps to itself.
WeightMap = Mapping[str, "str | tuple[str, str] | None"]


@dataclass(frozen=True)
class Architecture:
    model_types: tuple[str, ...]
    config: type  # a core.hfconfig.DecoderConfig subclass
    weight_map: WeightMap
    plugin: str


@dataclass(frozen=True)
class Format:
    name: str
    detect: Callable[[Path], bool]
    open: Callable[[Path], Any]  # -> core.checkpoint.Checkpoint
    plugin: str


class Registry:
    """What the plugins registered. Two plugins claiming one name is a `PluginError`."""

    def __init__(self) -> None:
        self.architectures: dict[str, Architecture] = {}
        self.formats: dict[str, Format] = {}
        self.current_plugin = "?"  # set while a plugin's hooks run, to credit what it adds

    def add_architecture(self, model_types, config: type, weight_map: WeightMap) -> None:
        """Handle config.json files whose `model_type` is one of `model_types`."""
        types = (model_types,) if isinstance(model_types, str) else tuple(model_types)
        arch = Architecture(types, config, dict(weight_map), self.current_plugin)
        for t in types:
            self._claim(self.architectures, t, arch, "model_type")

    def add_format(self, name: str, detect: Callable, open: Callable) -> None:
        """Read checkpoints for which `detect(path)` is true with `open(path)`."""
        self._claim(self.formats, name, Format(name, detect, open, self.current_plugin), "format")

    def _claim(self, table: dict, key: str, value: Any, what: str) -> None:
        if key in table:
            raise PluginError(
                f"{what} {key!r} is registered by both plugin {table[key].plugin!r} and plugin "
                f"{value.plugin!r}; uninstall or disable one of them"
            )
        table[key] = value

    def architecture(self, model_type: Any, source: str = "config.json") -> Architecture:
        """The architecture for a config's model_type, or a `ConfigError` saying what exists."""
        if not model_type:
            raise ConfigError(f"{source}: missing required field 'model_type'")
        if not isinstance(model_type, str):
            raise ConfigError(f"{source}: field 'model_type' must be a string, got {model_type!r}")
        arch = self.architectures.get(model_type)
        if arch is None:
            known = sorted(self.architectures)
            close = difflib.get_close_matches(str(model_type), known, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ConfigError(
                f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(known)}."
                f"{hint} Architectures come from plugins: see `zoo plugins`."
            )
        return arch

    def format_for(self, path: Path) -> Format:
        """The first registered format that recognises `path`."""
        for fmt in self.formats.values():
            if fmt.detect(path):
                return fmt
        raise CheckpointError(
            f"{path}: no checkpoint format recognises it (known: {', '.join(self.formats)}); "
            "expected a folder with config.json and *.safetensors"
        )


# plugin name -> (distribution, version) it came from, for `zoo plugins`
_SOURCES: dict[str, tuple[str, str]] = {}


def _register(
    pm: pluggy.PluginManager, load: Callable[[], Any], name: str, dist: str, version: str
) -> None:
    """The one path every plugin takes, built in or from an entry point."""
    try:
        plugin = load()
    except Exception as err:  # a broken third-party package must not take Zoo down
        log.warning("zoo: skipping plugin %s: failed to import: %s", name, err)
        return
    _SOURCES[name] = (dist, version)
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as err:
        raise PluginError(f"plugin {name!r} is invalid: {err}") from None


def _call(pm: pluggy.PluginManager, hook: str, registry: Registry) -> None:
    # Call each implementation on its own so the registry knows whom to credit.
    for impl in reversed(getattr(pm.hook, hook).get_hookimpls()):
        registry.current_plugin = impl.plugin_name
        impl.function(registry=registry)
    registry.current_plugin = "?"


@functools.cache
def plugin_manager() -> pluggy.PluginManager:
    """Load built-in plugins and the `zoo.plugins` entry points, once per process."""
    pm = pluggy.PluginManager("zoo")
    pm.add_hookspecs(hookspecs)
    for mod in BUILTIN_PLUGINS:
        _register(pm, functools.partial(importlib.import_module, mod), mod, "zoo", _own_version())
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist, version = (ep.dist.name, ep.dist.version) if ep.dist else ("?", "?")
        _register(pm, ep.load, f"{dist}:{ep.name}", dist, version)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as err:
        name = pm.get_name(err.plugin) or repr(err.plugin)
        raise PluginError(f"plugin {name!r}: {err}; check the hook's name") from None
    return pm


@functools.cache
def registry() -> Registry:
    """The registry filled by every loaded plugin."""
    pm, reg = plugin_manager(), Registry()
    _call(pm, "zoo_register_formats", reg)
    _call(pm, "zoo_register_architectures", reg)
    return reg


def _own_version() -> str:
    try:
        return version("zoo")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "source"


def describe_plugins() -> list[dict[str, Any]]:
    """Each loaded plugin: name, distribution, version, and what it registered."""
    pm, reg = plugin_manager(), registry()
    rows = []
    for name, _ in pm.list_name_plugin():
        dist, ver = _SOURCES.get(name, ("?", "?"))
        registers: dict[str, list[str]] = {}
        for kind, table in (("architectures", reg.architectures), ("formats", reg.formats)):
            names = sorted(k for k, v in table.items() if v.plugin == name)
            if names:
                registers[kind] = names
        rows.append({"name": name, "distribution": dist, "version": ver, "registers": registers})
    return rows
