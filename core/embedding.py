"""Embeddings of a decoder: how its final hidden states are pooled into one vector a text.

The pooling comes from the checkpoint's sentence-transformers files where it ships them
(`modules.json` naming a Pooling module and its `config.json`, e.g. `1_Pooling/config.json`; a
`Normalize` module: L2-normalized), as `SentenceTransformer(path)` pools; without them,
last-token and normalized for a Qwen3-Embedding-style repo (a folder, file or hub repo named
`*embedding*`, as Qwen3-Embedding's model card pools), else the mean of the tokens.
`Model.embed` runs it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import CheckpointError, RequestError

# sentence-transformers' Pooling config keys, in the order it concatenates them
MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "last",
}
UNSUPPORTED = ("pooling_mode_weightedmean_tokens",)
POOLING = "sentence_transformers.models.Pooling"
NORMALIZE = "sentence_transformers.models.Normalize"
TRANSFORMER = "sentence_transformers.models.Transformer"


@dataclass(frozen=True)
class Pooling:
    """How hidden states become an embedding: `modes` (each pools to a vector; several are
    concatenated, as sentence-transformers does), `normalize` (L2), and where that was read."""

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False
    source: str = "no sentence-transformers files"

    def __post_init__(self):
        bad = [m for m in self.modes if m not in MODES.values()]
        if bad or not self.modes:
            known = ", ".join(MODES.values())
            raise RequestError(f"unknown pooling {bad or '(none)'}; use one of {known}")

    def describe(self) -> str:
        """E.g. "last-token pooling, L2-normalized (1_Pooling/config.json + Normalize)"."""
        modes = "+".join("last-token" if m == "last" else m for m in self.modes)
        norm = ", L2-normalized" if self.normalize else ""
        return f"{modes} pooling{norm} ({self.source})"

    def apply(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """hidden (B, T, H) of right-padded rows holding lengths (B,) real tokens ->
        (B, H * len(modes)) float32; padding takes no part."""
        x = hidden.float()
        t = x.shape[1]
        lengths = lengths.to(x.device)
        real = torch.arange(t, device=x.device)[None, :] < lengths[:, None]  # (B, T)
        n = lengths.to(x.dtype)[:, None]
        parts = []
        for mode in self.modes:
            if mode == "cls":
                parts.append(x[:, 0])
            elif mode == "last":
                parts.append(x[torch.arange(x.shape[0], device=x.device), lengths - 1])
            elif mode == "max":
                parts.append(x.masked_fill(~real[..., None], float("-inf")).amax(dim=1))
            else:
                total = (x * real[..., None]).sum(dim=1)
                parts.append(total / (n if mode == "mean" else n.sqrt()))
        out = torch.cat(parts, dim=-1)
        return torch.nn.functional.normalize(out, dim=-1) if self.normalize else out


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not readable JSON ({err}); fix or remove it") from None


def has_sentence_transformers(path: Path) -> bool:
    """Whether the checkpoint folder ships sentence-transformers' `modules.json`."""
    return Path(path).is_dir() and (Path(path) / "modules.json").is_file()


def read_pooling(path: Path) -> Pooling:
    """The checkpoint's pooling: from its sentence-transformers files, else by its kind."""
    path = Path(path)
    if has_sentence_transformers(path):
        return _from_modules(path)
    name = _repo_name(path)
    if "embedding" in name.lower():  # e.g. Qwen3-Embedding-0.6B without its ST files
        return Pooling(("last",), True, f"an embedding repo's name: {name}")
    return Pooling()


def _repo_name(path: Path) -> str:
    """The folder's (or file's) name; in the hub cache (models--Org--Name/snapshots/<hash>),
    the repo's."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name


def _from_modules(path: Path) -> Pooling:
    modules = _read_json(path / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise CheckpointError(f"{path / 'modules.json'}: expected a list of module objects")
    kinds = [str(m.get("type", "")) for m in modules]
    other = [k for k in kinds if k not in (TRANSFORMER, POOLING, NORMALIZE)]
    if other:
        raise CheckpointError(
            f"{path / 'modules.json'}: module(s) {other} are not supported (Zoo pools the "
            "final hidden states: Transformer, Pooling, Normalize); use sentence-transformers"
        )
    pool = [m for m in modules if m.get("type") == POOLING]
    if not pool:  # the Transformer's token embeddings alone: not one vector a text
        raise CheckpointError(f"{path / 'modules.json'}: no {POOLING} module to pool with")
    where = path / str(pool[0].get("path", "")) / "config.json"
    cfg = _read_json(where) if where.is_file() else {"pooling_mode_mean_tokens": True}
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where}: expected a JSON object")
    bad = [k for k in UNSUPPORTED if cfg.get(k)]
    if bad:
        raise CheckpointError(f"{where}: {bad[0]} is not supported; use mean or last-token")
    modes = tuple(mode for key, mode in MODES.items() if cfg.get(key))
    if not modes:
        raise CheckpointError(f"{where}: no pooling_mode_* is true; set one")
    normalize = NORMALIZE in kinds
    return Pooling(modes, normalize, str(where.relative_to(path)) + " + Normalize" * normalize)
