"""The plugin manager: finds the plugins, runs their hooks once, and answers what they registered.

Built-in plugins (`BUILTIN_PLUGINS`) and every entry point in group `zoo.plugins` are registered
through one path, `_register`, then `check_pending()` catches hook implementations whose names
match no spec. Loading is lazy (on the first call to `registry()`), happens once per process
(thread-safe), and imports no torch unless a plugin does.

Entry-point plugins can be chosen with two environment variables, read when plugins load:
`ZOO_PLUGINS` (comma-separated allow-list; empty: none) and `ZOO_DISABLE_PLUGINS` (deny-list,
which wins). Each name matches a distribution (`zoo-granite`, any case, `-`/`_`/`.` alike), an
entry point's name, or the plugin's full name `dist:entry-point`. Built-ins always load.
A plugin that fails to import, or whose hook raises, is skipped with a warning.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, entry_points, version
from typing import Any

import pluggy

from core import hookspecs
from core.errors import PluginError, ZooError
from core.plugin_registry import (
    Architecture,
    Format,
    Layer,
    NamedModel,
    Registry,
    ToolFormat,
    WeightMap,
    WeightScales,
)

__all__ = [
    "Architecture",
    "Format",
    "Layer",
    "NamedModel",
    "Registry",
    "ToolFormat",
    "WeightMap",
    "WeightScales",
    "describe_plugins",
    "merge_named_models",
    "plugin_manager",
    "registry",
    "skipped_plugins",
]

log = logging.getLogger("zoo")

ENTRY_POINT_GROUP = "zoo.plugins"
BUILTIN_PLUGINS = (
    "plugins.core_layers",
    "plugins.llama3",
    "plugins.qwen2",
    "plugins.qwen3",
    "plugins.mistral",
    "plugins.smollm3",
    "plugins.phi3",
    "plugins.gemma",
    "plugins.gemma4",
    "plugins.deepseek",
    "plugins.deepseek_v32",
    "plugins.mixtral",
    "plugins.gpt_oss",
    "plugins.qwen3_moe",
    "plugins.qwen3_next",
    "plugins.nemotron_h",
    "plugins.olmo",
    "plugins.ministral",
    "plugins.kimi",
    "plugins.llama4",
    "plugins.glm4_moe",
    "plugins.minimax_m2",
    "plugins.deepseek_v4",
    "plugins.granite_hybrid",
    "plugins.lfm2",
    "plugins.falcon_h1",
    "plugins.formats.safetensors",
    "plugins.formats.gguf",
    "plugins.tool_formats",
)
# every hook, in the order core/hookspecs.py defines them
HOOKS = tuple(name for name in vars(hookspecs) if name.startswith("zoo_"))


@dataclass
class PluginInfo:
    name: str  # a built-in's module, or "distribution:entry-point"
    distribution: str
    version: str
    skipped: str | None = None  # why it is not loaded; None: loaded


@dataclass
class _Loaded:
    pm: pluggy.PluginManager
    registry: Registry
    plugins: dict[str, PluginInfo]


_lock = threading.RLock()
_loaded: _Loaded | None = None
_loading = False


def _load() -> _Loaded:
    pm = pluggy.PluginManager("zoo")
    pm.add_hookspecs(hookspecs)
    plugins: dict[str, PluginInfo] = {}
    for mod in BUILTIN_PLUGINS:
        info = PluginInfo(mod, "zoo", _own_version())
        _register(pm, info, lambda mod=mod: importlib.import_module(mod), plugins)
    _load_entry_points(pm, plugins)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as err:
        name = pm.get_name(err.plugin) or repr(err.plugin)
        raise PluginError(f"plugin {name!r}: {err}; check the hook's name") from None
    return _Loaded(pm, _fill(pm, plugins), plugins)


def _load_entry_points(pm: pluggy.PluginManager, plugins: dict[str, PluginInfo]) -> None:
    """Register the `zoo.plugins` entry points that ZOO_PLUGINS / ZOO_DISABLE_PLUGINS let in."""
    lists = {var: _names(var) for var in ("ZOO_PLUGINS", "ZOO_DISABLE_PLUGINS")}
    allow, deny = lists["ZOO_PLUGINS"], lists["ZOO_DISABLE_PLUGINS"] or set()
    seen: set[str] = set()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist, ver = (ep.dist.name, ep.dist.version) if ep.dist else ("?", "?")
        info = PluginInfo(f"{dist}:{ep.name}", dist, ver)
        keys = {_norm(dist), _norm(ep.name), f"{_norm(dist)}:{_norm(ep.name)}"}
        seen |= keys
        if keys & deny:
            info.skipped = "disabled by ZOO_DISABLE_PLUGINS"
        elif allow is not None and not keys & allow:
            info.skipped = "not named in ZOO_PLUGINS"
        if info.skipped:
            log.info("zoo: plugin %s (%s %s) %s", info.name, dist, ver, info.skipped)
            plugins.setdefault(info.name, info)
            continue
        _register(pm, info, ep.load, plugins)
    for var, names in lists.items():
        for name in sorted((names or set()) - seen):  # most likely a typo
            log.warning("zoo: %s names %r, which matches no installed plugin", var, name)


def _register(
    pm: pluggy.PluginManager, info: PluginInfo, load: Callable[[], Any], plugins: dict
) -> None:
    """The one path every plugin takes, built in or from an entry point."""
    if info.name in plugins:  # the same distribution found twice on sys.path: first wins
        return
    plugins[info.name] = info
    try:
        plugin = load()
    except Exception as err:  # a broken third-party package must not take Zoo down
        info.skipped = f"failed to import: {type(err).__name__}: {err}"
        log.warning("zoo: skipping plugin %s (%s): %s", info.name, info.distribution, info.skipped)
        return
    if pm.is_registered(plugin):  # idempotent: one module behind two names loads once
        info.skipped = f"the same object is already loaded as plugin {pm.get_name(plugin)!r}"
        log.debug("zoo: plugin %s: %s", info.name, info.skipped)
        return
    try:
        pm.register(plugin, name=info.name)
    except pluggy.PluginValidationError as err:
        raise PluginError(f"plugin {info.name!r} ({info.distribution}) is invalid: {err}") from None


def _fill(pm: pluggy.PluginManager, plugins: dict[str, PluginInfo]) -> Registry:
    """Run every plugin's hooks into one registry, crediting each addition to its plugin."""
    reg = Registry()
    for name, _ in pm.list_name_plugin():
        reg.current_plugin = name
        try:
            for hook in HOOKS:
                for impl in getattr(pm.hook, hook).get_hookimpls():
                    if impl.plugin_name == name:
                        impl.function(registry=reg)
        except ZooError:
            raise  # a duplicate claim, or a bad registration: the message names the plugin
        except Exception as err:
            reg.forget(name)
            pm.unregister(name=name)
            info = plugins[name]
            info.skipped = f"{hook} failed: {type(err).__name__}: {err}"
            log.warning("zoo: skipping plugin %s (%s): %s", name, info.distribution, info.skipped)
    reg.current_plugin = "?"
    return reg


def _names(var: str) -> set[str] | None:
    """The normalised names in a comma-separated variable; None when it is unset."""
    raw = os.environ.get(var)
    return None if raw is None else {_norm(n) for n in raw.split(",") if n.strip()}


def _norm(name: str) -> str:
    """Distribution names compare like pip's: any case, runs of - _ . alike."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def _own_version() -> str:
    try:
        return version("zoo")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "source"


def _state() -> _Loaded:
    global _loaded, _loading
    with _lock:
        if _loaded is None:
            if _loading:
                raise PluginError(
                    "a plugin asked for the registry while plugins were loading; a hook must "
                    "only add to the registry object it is given"
                )
            _loading = True
            try:
                _loaded = _load()
            finally:
                _loading = False
        return _loaded


def plugin_manager() -> pluggy.PluginManager:
    """The pluggy manager with every loaded plugin (loading them on first use)."""
    return _state().pm


def registry() -> Registry:
    """The registry filled by every loaded plugin (loading them on first use)."""
    return _state().registry


def describe_plugins() -> list[dict[str, Any]]:
    """Each loaded plugin: name, distribution, version, and what it registered."""
    state = _state()
    rows = []
    for name, _ in state.pm.list_name_plugin():
        info = state.plugins[name]
        rows.append(
            {
                "name": name,
                "distribution": info.distribution,
                "version": info.version,
                "registers": state.registry.registered_by(name),
            }
        )
    return rows


def skipped_plugins() -> list[PluginInfo]:
    """Plugins found but not loaded, each with the reason (`.skipped`)."""
    return [p for p in _state().plugins.values() if p.skipped]


def merge_named_models(models: dict[str, dict], source: str) -> dict[str, dict]:
    """registry.yaml's named models (read from `source`) plus those the plugins registered;
    a name in both is a `PluginError` naming the file and the plugin."""
    merged = dict(models)
    for name, model in registry().models.items():
        if name in merged:
            raise PluginError(
                f"model name {name!r} is defined by both {source} and plugin {model.plugin!r}; "
                "rename one of them, or leave the plugin out with ZOO_DISABLE_PLUGINS"
            )
        merged[name] = dict(model.entry)
    return merged
