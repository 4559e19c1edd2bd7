"""The registry plugins fill: architectures, checkpoint formats, layer kinds, named models and
tool-call formats.

Each hook in `core.hookspecs` receives one `Registry`; whatever a plugin adds is credited to it
(`current_plugin`), and two plugins claiming one name is a `PluginError` naming both. Nothing
here imports torch: layer modules given as "module:Class" strings are imported on first use.
"""

from __future__ import annotations

import difflib
import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import CheckpointError, ConfigError, PluginError

# checkpoint module path (integers as "{}") -> core module path, or (core path, shard name),
# or None to skip the tensor. Anything not listed maps to itself. A key ending in ".*" is a
# prefix rule, applied first: "model.language_model.*": "model.*" renames everything under it,
# "model.vision_tower.*": None skips it all (core.loader.strip_prefix).
WeightMap = Mapping[str, "str | tuple[str, str] | None"]
# checkpoint tensor name (integers as "{}") -> what the loader multiplies it by as it reads it:
# a float, or (rows, factor) segments along its first dim (core.loader.scale_tensor)
WeightScales = Mapping[str, "float | tuple[tuple[int, float], ...]"]


@dataclass(frozen=True)
class Architecture:
    model_types: tuple[str, ...]
    config: type  # a core.hfconfig.DecoderConfig subclass
    weight_map: WeightMap
    plugin: str
    scales: WeightScales = field(default_factory=dict)  # the config's `weight_scales()`


@dataclass(frozen=True)
class Format:
    name: str
    detect: Callable[[Path], bool]
    open: Callable[[Path], Any]  # -> core.checkpoint.Checkpoint
    plugin: str


@dataclass(frozen=True)
class Layer:
    spec_type: type  # e.g. core.config.RMSNormSpec
    module: type | str  # an nn.Module class, or "package.module:Class"
    plugin: str

    @functools.cached_property
    def module_class(self) -> type:
        """The module class, imported now if it was given as a string."""
        if not isinstance(self.module, str):
            return self.module
        path, _, attr = self.module.partition(":")
        try:
            return functools.reduce(getattr, attr.split("."), importlib.import_module(path))
        except (ImportError, AttributeError) as err:
            raise PluginError(
                f"plugin {self.plugin!r}: layer module {self.module!r} for "
                f"{self.spec_type.__name__} cannot be imported ({err}); fix or disable the plugin"
            ) from None


@dataclass(frozen=True)
class ToolFormat:
    name: str
    detect: Callable[[str], bool]  # chat template -> whether it teaches this format
    grammar: Callable  # a core.chat.tool_formats.call_stream.Grammar
    call_id: Callable[[], str] | None  # None: OpenAI's ids
    plugin: str


@dataclass(frozen=True)
class NamedModel:
    name: str
    entry: dict[str, Any]  # registry.yaml's shape: repo + revision | package + file, and info
    plugin: str


class Registry:
    """What the plugins registered. Two plugins claiming one name is a `PluginError`."""

    def __init__(self) -> None:
        self.architectures: dict[str, Architecture] = {}
        self.formats: dict[str, Format] = {}
        self.layers: dict[type, Layer] = {}
        self.models: dict[str, NamedModel] = {}
        self.tool_formats: dict[str, ToolFormat] = {}
        self.current_plugin = "?"  # set while a plugin's hooks run, to credit what it adds

    # --- what the hooks call -----------------------------------------------------------------
    def add_architecture(self, model_types, config: type, weight_map: WeightMap) -> None:
        """Handle config.json files whose `model_type` is one of `model_types`."""
        types = (model_types,) if isinstance(model_types, str) else tuple(model_types)
        arch = Architecture(types, config, dict(weight_map), self.current_plugin)
        for t in types:
            self._claim(self.architectures, t, arch, f"model_type {t!r}")

    def add_format(self, name: str, detect: Callable, open: Callable) -> None:
        """Read checkpoints for which `detect(path)` is true with `open(path)`."""
        fmt = Format(name, detect, open, self.current_plugin)
        self._claim(self.formats, name, fmt, f"format {name!r}")

    def add_layer(self, spec_type: type, module: type | str) -> None:
        """Build `module(...)` wherever a `RuntimeConfig` holds a `spec_type` instance."""
        if not isinstance(spec_type, type):
            raise PluginError(
                f"plugin {self.current_plugin!r}: add_layer wants a spec class, got {spec_type!r}"
            )
        if not isinstance(module, type) and not (isinstance(module, str) and ":" in module):
            raise PluginError(
                f"plugin {self.current_plugin!r}: add_layer({spec_type.__name__}, ...) wants an "
                f"nn.Module class or a 'package.module:Class' string, got {module!r}"
            )
        layer = Layer(spec_type, module, self.current_plugin)
        self._claim(self.layers, spec_type, layer, f"layer spec {spec_type.__name__}")

    def add_model(
        self,
        name: str,
        *,
        architecture: str,
        repo: str | None = None,
        revision: str = "main",
        package: str | None = None,
        file: str | None = None,
        dtype: str = "bfloat16",
        params: str = "?",
        notes: str = "",
    ) -> None:
        """A short name for a hub `repo` (at `revision`) or a `file` inside pip `package`."""
        if not isinstance(name, str) or not name or (repo is None) == (package is None):
            raise PluginError(
                f"plugin {self.current_plugin!r}: add_model({name!r}) needs a non-empty name and "
                "either repo= (a hub repo id) or package= and file= (a file in a pip package)"
            )
        if package is not None and not file:
            raise PluginError(
                f"plugin {self.current_plugin!r}: add_model({name!r}, package={package!r}) "
                "needs file= (the file's name inside the package)"
            )
        source = (
            {"repo": repo, "revision": revision} if repo else {"package": package, "file": file}
        )
        info = {"architecture": architecture, "dtype": dtype, "params": params, "notes": notes}
        entry = {**source, **info, "plugin": self.current_plugin}
        model = NamedModel(name, entry, self.current_plugin)
        self._claim(self.models, name, model, f"model name {name!r}")

    def add_tool_format(
        self, name: str, detect: Callable, grammar: Callable, call_id: Callable | None = None
    ) -> None:
        """Read the tool calls of models whose chat template `detect` accepts by `grammar`."""
        ok = isinstance(name, str) and name and callable(detect) and callable(grammar)
        if not ok or not (call_id is None or callable(call_id)):
            raise PluginError(
                f"plugin {self.current_plugin!r}: add_tool_format({name!r}, ...) needs a "
                "non-empty name, a detect(chat_template) function, a grammar and call_id() or None"
            )
        fmt = ToolFormat(name, detect, grammar, call_id, self.current_plugin)
        self._claim(self.tool_formats, name, fmt, f"tool-call format {name!r}")

    def _claim(self, table: dict, key: Any, value: Any, what: str) -> None:
        if key in table:
            raise PluginError(
                f"{what} is registered by both plugin {table[key].plugin!r} and plugin "
                f"{value.plugin!r}; uninstall one of them, or leave one out with "
                "ZOO_DISABLE_PLUGINS"
            )
        table[key] = value

    def forget(self, plugin: str) -> None:
        """Drop everything `plugin` registered (its hook failed half way)."""
        tables = (self.architectures, self.formats, self.layers, self.models, self.tool_formats)
        for table in tables:
            for key in [k for k, v in table.items() if v.plugin == plugin]:
                del table[key]

    def registered_by(self, plugin: str) -> dict[str, list[str]]:
        """What one plugin registered, by kind, for `zoo plugins`."""
        kinds = {
            "architectures": sorted(k for k, v in self.architectures.items() if v.plugin == plugin),
            "formats": sorted(k for k, v in self.formats.items() if v.plugin == plugin),
            "layers": [t.__name__ for t, v in self.layers.items() if v.plugin == plugin],
            "models": sorted(k for k, v in self.models.items() if v.plugin == plugin),
            "tool_formats": [k for k, v in self.tool_formats.items() if v.plugin == plugin],
        }
        return {kind: names for kind, names in kinds.items() if names}

    # --- what the core asks ------------------------------------------------------------------
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

    def layer(self, spec: Any) -> type:
        """The module class registered for the type of `spec` (exactly that type)."""
        entry = self.layers.get(type(spec))
        if entry is None:
            t = type(spec)
            known = ", ".join(k.__name__ for k in self.layers)
            raise PluginError(
                f"{t.__module__}.{t.__qualname__}: no layer module is registered for this spec "
                f"type (registered: {known}); the plugin that uses it must call "
                f"registry.add_layer({t.__name__}, ...) in its zoo_register_layers hook"
            )
        return entry.module_class
