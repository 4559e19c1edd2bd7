"""The safetensors checkpoint format: a hub-style folder with config.json and one
`model.safetensors` or shards listed in `model.safetensors.index.json`. Memory-mapped; never
unpickles anything. Block-scaled fp8 weights (DeepSeek-V3/R1) are offered kept
(`quant_format` / `read_quantized`, taken on CUDA sm89+: core/quantize.py) or dequantized as
they are read (safetensors_fp8.py)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

from core.checkpoint import read_json
from core.errors import CheckpointError
from core.hookspecs import hookimpl
from plugins.formats import safetensors_dsv4 as dsv4
from plugins.formats import safetensors_mxfp4 as mxfp4
from plugins.formats.safetensors_fp8 import SCALE_SUFFIX, BlockFP8

INDEX = "model.safetensors.index.json"
ITEMSIZE = {
    **{"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1},
    **{"I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1},
    "F8_E8M0": 1,  # DeepSeek V4's scales (safetensors_dsv4.py)
}
_TORCH_DTYPES = {
    **{"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "BOOL": "bool"},
    **{"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U8": "uint8", "I8": "int8"},
    **{"I16": "int16", "I32": "int32", "I64": "int64", "U16": "uint16", "U32": "uint32"},
    "U64": "uint64",
    "F8_E8M0": "uint8",  # read as the exponent bytes
}
MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header


def check_file(f: Path) -> tuple[dict[str, Any], int]:
    """Validate a safetensors file's framing: say what the file really is (empty, a git-LFS
    pointer, an HTML page, truncated) and reject bad offsets. Returns (header, data start)."""
    size = f.stat().st_size
    with f.open("rb") as fh:
        head = fh.read(min(size, 512))
        if size == 0:
            raise CheckpointError(f"{f}: the file is empty (0 bytes); download it again")
        if head.startswith(b"version https://git-lfs"):
            raise CheckpointError(
                f"{f}: this is a git-LFS pointer file, not the weights; fetch the real file "
                "with `git lfs pull` or download it from the hub"
            )
        if head.lstrip()[:15].lower().startswith((b"<!doctype", b"<html")):
            raise CheckpointError(
                f"{f}: this is an HTML page (an error or login page saved in place of the "
                "weights); download the file again"
            )
        if size < 8:
            raise CheckpointError(f"{f}: truncated ({size} bytes); download it again")
        n = int.from_bytes(head[:8], "little")
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                f"{f}: header claims {n:,} bytes but the file has {size:,}; the file is "
                "truncated or not safetensors, download it again"
            )
        fh.seek(8)
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{f}: corrupt safetensors header ({err})") from None
    _check_offsets(f, header, size - 8 - n)
    header.pop("__metadata__", None)
    return header, 8 + n


def _check_offsets(f: Path, header: Any, data_size: int) -> None:
    if not isinstance(header, dict):
        raise CheckpointError(f"{f}: corrupt safetensors header (not a JSON object)")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            dims = list(info["shape"])
            if not all(type(x) is int and x >= 0 for x in (begin, end, *dims)):
                raise ValueError  # checked before the product: int * str repeats the string
            need = math.prod(dims) * ITEMSIZE[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{f}: corrupt header entry for tensor {name!r}") from None
        if not 0 <= begin <= end <= data_size or end - begin != need:
            raise CheckpointError(
                f"{f}: tensor {name!r} has offsets [{begin}, {end}) outside the {data_size:,} "
                f"data bytes or not matching its {need:,} bytes; the file is corrupt or truncated"
            )
        spans.append((begin, end, name))
    spans.sort()
    for (_, end_a, a), (begin_b, _, b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise CheckpointError(f"{f}: tensors {a!r} and {b!r} overlap; the file is corrupt")


class SafetensorsCheckpoint:
    """Reads tensors with plain file reads into their own buffers (no memory map), so loading
    never holds more than the model plus one tensor: no file pages pile up in the process."""

    def __init__(self, path: Path):
        self.path = path
        files, listed = self._shards(path)
        self._where: dict[str, tuple[Path, int, dict]] = {}  # name -> (file, data start, entry)
        for f in files:
            header, start = check_file(f)
            for name, entry in header.items():
                self._where[name] = (f, start, entry)
        absent = sorted(n for n in listed if n not in self._where)
        if absent:
            raise CheckpointError(
                f"{path / INDEX} names {len(absent)} tensor(s) no shard holds: "
                f"{', '.join(absent[:5])}; the index and the shards do not match, re-download them"
            )
        self._handles: dict[Path, Any] = {}  # the last file read_slice opened
        self._mxfp4 = False  # MXFP4 blocks + scales (gpt-oss): see safetensors_mxfp4.py
        self._dsv4 = False  # DeepSeek V4's weight + e8m0 scale pairs: see safetensors_dsv4.py
        self._fp8 = self._fp8_scheme()

    def _fp8_scheme(self) -> BlockFP8 | None:
        """config.json's fp8 scheme, its tensors checked against it (None: no quantization,
        or MXFP4, which sets `_mxfp4`)."""
        f = self.path / "config.json"
        config = read_json(f) if f.is_file() else {}
        qc = config.get("quantization_config") if isinstance(config, dict) else None
        header = {name: entry for name, (_, _, entry) in self._where.items()}
        if dsv4.declared(header):
            for name, entry in header.items():
                scale = dsv4.scale_of(name)
                if scale in header:
                    dsv4.check(name, entry, header[scale], self.path)
            self._dsv4 = True
            return None
        if isinstance(qc, dict) and qc.get("quant_method") == "mxfp4":
            mxfp4.check(header, self.path)
            self._mxfp4 = True
            return None
        fp8 = BlockFP8.from_config(config, f) if f.is_file() else None
        if fp8 is not None:
            fp8.check(header, self.path)
        return fp8

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
        if self._mxfp4:  # the scales are read with their blocks
            return [n for n in self._where if not n.endswith(mxfp4.SCALES)]
        if self._dsv4:  # the scales are read with their weights
            scales = {dsv4.scale_of(n) for n in self._where}
            return [n for n in self._where if n not in scales]
        if self._fp8 is None:
            return list(self._where)
        return [n for n in self._where if not n.endswith(SCALE_SUFFIX)]  # read with their weight

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as `read` returns it (MXFP4 blocks: dequantized)."""
        stored = tuple(int(d) for d in self._where[name][2]["shape"])
        if self._paired(name):
            return dsv4.shape(stored, self._where[name][2]["dtype"])
        return mxfp4.shape(stored) if self._mxfp4 and name.endswith(mxfp4.BLOCKS) else stored

    def _paired(self, name: str) -> bool:
        """Whether `name` is a DeepSeek V4 weight with its scale beside it."""
        return self._dsv4 and dsv4.scale_of(name) in self._where

    def read(self, name: str):
        """The tensor in its stored dtype; an fp8 weight dequantized by its block scales, fp32."""
        if self._mxfp4 and name.endswith(mxfp4.BLOCKS):
            scales = self._read(name.removesuffix(mxfp4.BLOCKS) + mxfp4.SCALES)
            return mxfp4.dequantize(self._read(name), scales)
        if self._paired(name):
            return dsv4.dequantize(self._read(name), self._read(dsv4.scale_of(name)))
        t = self._read(name)
        if self.quant_format(name) is not None:
            self._fp8.check_values(name, t, self.path)
            return self._fp8.dequantize(t, self._read(name + SCALE_SUFFIX))
        return t

    def quant_format(self, name: str) -> str | None:
        """`fp8_e4m3` for a block-scaled fp8 weight, `mxfp4` for MXFP4 blocks, None for
        floats."""
        if self._fp8 is not None and name + SCALE_SUFFIX in self._where:
            from kernels.qweight import FP8  # torch loads only when weights are read

            return FP8
        if self._mxfp4 and name.endswith(mxfp4.BLOCKS):
            return "mxfp4"
        return None

    def blocks(self, name: str):
        """MXFP4 blocks as GGML stores them ((..., rows, bytes per row) uint8; the loader asks
        only where core/quantize.py keeps MXFP4: CPUs), in the stored row order (None)."""
        scales = self._read(name.removesuffix(mxfp4.BLOCKS) + mxfp4.SCALES)
        return "mxfp4", mxfp4.to_ggml(self._read(name), scales), None

    def stored_bytes(self, name: str) -> int:
        """The tensor's bytes in the file (MXFP4: its blocks and scales)."""
        names = [name]
        if self._mxfp4 and name.endswith(mxfp4.BLOCKS):
            names.append(name.removesuffix(mxfp4.BLOCKS) + mxfp4.SCALES)
        total = 0
        for n in names:
            begin, end = self._where[n][2]["data_offsets"]
            total += end - begin
        return total

    def read_quantized(self, name: str):
        """An fp8 weight and its scales as a `QuantWeight`, the bytes as stored (the loader
        asks only where core/quantize.py keeps fp8: GPUs of compute capability 8.9+); MXFP4
        blocks as a `QuantWeight` or, stacked experts, a `QuantExperts` (GPUs), losslessly."""
        if self._mxfp4 and name.endswith(mxfp4.BLOCKS):
            scales = self._read(name.removesuffix(mxfp4.BLOCKS) + mxfp4.SCALES)
            return mxfp4.keep(self._read(name), scales)
        t = self._read(name)
        self._fp8.check_values(name, t, self.path)
        return self._fp8.keep(t, self._read(name + SCALE_SUFFIX))

    def read_slice(self, name: str, dim: int, ranges):
        """Parts of a tensor along `dim`, the (start, stop) `ranges` concatenated: a
        tensor-parallel rank's share (core/parallel/tp.py), read with safetensors' `get_slice` so
        that only those bytes leave the file. None for a weight stored quantized (fp8, MXFP4),
        which is read whole, dequantized, then cut."""
        if (
            (self._mxfp4 and name.endswith(mxfp4.BLOCKS))
            or self._paired(name)
            or (self._fp8 is not None and name + SCALE_SUFFIX in self._where)
        ):
            return None
        import torch
        from safetensors import safe_open

        f = self._where[name][0]
        if f not in self._handles:  # one file mapped at a time: its pages leave with it
            self._handles = {f: safe_open(f, framework="pt")}
        part = self._handles[f].get_slice(name)
        lead = (slice(None),) * dim
        return torch.cat([part[(*lead, slice(a, b))] for a, b in ranges], dim)

    def _read(self, name: str):
        import torch

        f, start, entry = self._where[name]
        begin, end = entry["data_offsets"]
        dtype = _TORCH_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{f}: tensor {name!r} has unsupported dtype {entry['dtype']}")
        buf = torch.empty(end - begin, dtype=torch.uint8)
        with f.open("rb") as fh:
            fh.seek(start + begin)
            if fh.readinto(memoryview(buf.numpy())) != end - begin:
                raise CheckpointError(f"{f}: truncated while reading {name!r}; download it again")
        stored = tuple(int(d) for d in entry["shape"])
        return buf.view(getattr(torch, dtype)).reshape(stored)

    def close(self) -> None:
        self._where.clear()
        self._handles.clear()


def _detect(path: Path) -> bool:
    return path.is_dir()


@hookimpl
def zoo_register_formats(registry):
    registry.add_format("safetensors", detect=_detect, open=SafetensorsCheckpoint)
