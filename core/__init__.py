"""Zoo's core runtime. `from core import load_model, ZooError`.

Errors import eagerly; everything that pulls in torch loads on first use, so listing models
and plugins stays fast.
"""

from core.errors import CheckpointError, ConfigError, HubError, PluginError, RequestError, ZooError

__all__ = [
    "CheckpointError",
    "ConfigError",
    "GenerationResult",
    "HubError",
    "Model",
    "PluginError",
    "RequestError",
    "ZooError",
    "load_model",
]

_LAZY = {"load_model": "core.api", "Model": "core.model", "GenerationResult": "core.generation"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'core' has no attribute {name!r}")
