"""Named models: the `registry.yaml` table that maps short names to hub repos or packaged files."""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from core.errors import ConfigError


def registry_path() -> Path:
    """registry.yaml: package data in an installed wheel, the repo's top level in a checkout."""
    packaged = Path(str(resources.files("core") / "registry.yaml"))
    if packaged.is_file():
        return packaged
    return Path(__file__).resolve().parent.parent / "registry.yaml"


@functools.cache
def named_models() -> dict[str, dict[str, Any]]:
    """name -> entry: `repo` + `revision` (a hub repo), or `package` + `file` (a file shipped
    in a pip package); plus architecture, dtype, params and notes for `zoo list`."""
    path = registry_path()
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot read the model registry ({err})") from None
    models = data.get("models")
    if not isinstance(models, dict):
        raise ConfigError(f"{path}: expected a top-level 'models' mapping")
    for name, entry in models.items():
        if not isinstance(entry, dict) or not (
            "repo" in entry or {"package", "file"} <= set(entry)
        ):
            raise ConfigError(
                f"{path}: model {name!r} needs a 'repo' (hub repo id) or a 'package' and 'file' "
                "(a file inside a pip package)"
            )
    from core.plugins import merge_named_models  # plugins add names via zoo_register_models

    return merge_named_models(models, str(path))
