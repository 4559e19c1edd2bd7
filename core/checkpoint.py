"""What a checkpoint format plugin provides: a `Checkpoint` reader over hub-style tensor names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from core.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from core.tokenizer import Tokenizer


class Checkpoint(Protocol):
    """A read-only view of one checkpoint. Tensor names are in the hub's (transformers') style."""

    path: Path

    def config(self) -> dict[str, Any]:
        """The model's config.json as a dict (for formats without one: built from metadata)."""

    def tensor_names(self) -> list[str]:
        """Every tensor the checkpoint holds."""

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, read from metadata only."""

    def read(self, name: str) -> torch.Tensor:
        """The tensor itself, on the CPU, in its stored dtype (or decoded: a block-fp8 weight
        comes dequantized by its scales, in fp32)."""

    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (with chat template and special tokens), or None if it has none."""

    def generation_config(self) -> dict[str, Any]:
        """generation_config.json-style defaults ({} when the checkpoint has none)."""

    def close(self) -> None:
        """Release file handles and maps."""


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file; a missing or malformed file raises `ConfigError` naming it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found; a model folder needs a config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err}); re-download the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
