"""The safetensors checkpoint format: a hub-style folder with config.json and one
`model.safetensors` or shards listed in `model.safetensors.index.json`. Memory-mapped; never
unpickles anything."""

from __future__ import annotations

from pathlib import Path

from core.checkpoint import read_json
from core.errors import CheckpointError
from core.hookspecs import hookimpl

INDEX = "model.safetensors.index.json"


class SafetensorsCheckpoint:
    def __init__(self, path: Path):
        from safetensors import SafetensorError, safe_open

        self.path = path
        files, listed = self._shards(path)
        self._handles = {}
        for f in files:
            try:
                self._handles[f] = safe_open(f, framework="pt", device="cpu")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(
                    f"{f}: not a readable safetensors file ({err}); re-download it"
                ) from None
        self._where = {}
        for h in self._handles.values():
            for name in h.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                self._where[name] = h
        absent = sorted(n for n, f in listed.items() if n not in self._where)
        if absent:
            raise CheckpointError(
                f"{path / INDEX} names {len(absent)} tensor(s) no shard holds: "
                f"{', '.join(absent[:5])}; the index and the shards do not match, re-download them"
            )

    @staticmethod
    def _shards(path: Path) -> tuple[list[Path], dict[str, Path]]:
        """The shard files, each checked to exist before any is opened."""
        if (path / INDEX).exists():
            weight_map = read_json(path / INDEX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{path / INDEX}: has no 'weight_map' object")
            listed = {name: path / str(f) for name, f in weight_map.items()}
            files = sorted(set(listed.values()))
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(
                    f"{path / INDEX} lists shard(s) that are missing: {', '.join(missing)}; "
                    "download them again"
                )
            return files, listed
        files = sorted(path.glob("*.safetensors"))
        if not files:
            pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
            extra = (
                f" It has {', '.join(pickles)}: pickle checkpoints are refused because loading "
                "them can run code; convert them to safetensors."
                if pickles
                else ""
            )
            raise CheckpointError(f"{path}: no *.safetensors weights found.{extra}")
        return files, {}

    def config(self) -> dict:
        return read_json(self.path / "config.json")

    def tokenizer(self):
        from core.tokenizer import Tokenizer

        return Tokenizer.from_folder(self.path)

    def generation_config(self) -> dict:
        f = self.path / "generation_config.json"
        return read_json(f) if f.is_file() else {}

    def tensor_names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def read(self, name: str):
        return self._where[name].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()
        self._where.clear()


def _detect(path: Path) -> bool:
    return path.is_dir()


@hookimpl
def zoo_register_formats(registry):
    registry.add_format("safetensors", detect=_detect, open=SafetensorsCheckpoint)
