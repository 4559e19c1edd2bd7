"""Named models: the `registry.yaml` table that maps short names to hub repos."""

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
    """name -> entry (repo, revision, architecture, dtype, params, notes)."""
    path = registry_path()
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot read the model registry ({err})") from None
    models = data.get("models")
    if not isinstance(models, dict):
        raise ConfigError(f"{path}: expected a top-level 'models' mapping")
    return models
