"""The GGUF container: metadata, tensor infos, and tensors dequantized by the `gguf` package.

The header is parsed here (layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
rather than by `gguf.GGUFReader`, which builds one numpy view per string and takes seconds on a
50k-token vocabulary. Tensor bytes are memory-mapped; `gguf.quants.dequantize` turns each block
format into float32. Every malformed file is a `CheckpointError` naming the file.
"""

from __future__ import annotations

import functools
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.errors import CheckpointError

if TYPE_CHECKING:
    import torch

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 counted in 32-bit ints; llama.cpp dropped it in 2023
FLOAT32, STRING, ARRAY = 6, 8, 9
# metadata value type -> struct format (the two variable-size types, string and array, aside)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_LENGTH = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: GGUF lists dimensions innermost first
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int


class _Cursor:
    """Reads little-endian values from the header, reporting a short file as truncated."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise CheckpointError(
                f"{self.path}: truncated GGUF header (needs {self.pos + n} bytes, the file has "
                f"{len(self.buf)}); re-download it"
            )
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def scalar(self, kind: int) -> Any:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return str(self.take(self.scalar(10)), "utf-8", errors="replace")

    def strings(self, n: int) -> list[str]:
        """n strings, each a uint64 length and its UTF-8 bytes."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        unpack, append = _LENGTH.unpack_from, out.append
        try:
            for _ in range(n):
                (size,) = unpack(buf, pos)
                pos += 8
                if pos + size > end:
                    raise struct.error
                append(str(buf[pos : pos + size], "utf-8", "replace"))
                pos += size
        except struct.error:
            self.pos = end
            self.take(8)  # reports the truncation
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, n = self.scalar(4), self.scalar(10)
            if item in _SCALARS:  # one numpy read for the whole array (token types, scores)
                dtype = np.dtype(_SCALARS[item])
                return np.frombuffer(self.take(n * dtype.itemsize), dtype).tolist()
            if item == STRING:  # a vocabulary, its merges: 100k+ strings in one tight loop
                return self.strings(n)
            return [self.value(item) for _ in range(n)]
        if kind not in _SCALARS:
            raise CheckpointError(f"{self.path}: unknown GGUF metadata value type {kind}")
        if kind == FLOAT32:  # the shortest decimal that is this float32: 1e-06, not 9.99e-07
            return float(str(np.float32(self.scalar(kind))))
        return self.scalar(kind)


class GGUFFile:
    """One .gguf file: `metadata` (key -> value), `tensors` (name -> TensorInfo), `read(name)`."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        if size < 24:
            raise CheckpointError(f"{path}: {size} bytes is too short for a GGUF file")
        with path.open("rb") as f:  # private and read-only: the page cache's pages, shared
            self._mmap = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        self._map = np.frombuffer(self._mmap, dtype=np.uint8)
        cur = _Cursor(memoryview(self._map), path)
        magic = bytes(cur.take(4))
        if magic != MAGIC:
            raise CheckpointError(
                f"{path}: not a GGUF file (starts with {magic!r}, expected {MAGIC!r}); "
                "re-download it or check that it is not an HTML page or a git-LFS pointer"
            )
        self.version = cur.scalar(4)
        if self.version not in VERSIONS:
            raise CheckpointError(
                f"{path}: unsupported GGUF version {self.version} (supported: "
                f"{', '.join(map(str, VERSIONS))}); convert it again with a current llama.cpp"
            )
        n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar(4))
        infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-cur.pos // align) * align  # the data section begins at the next multiple
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, kind, offset in infos:
            info = TensorInfo(name, shape, kind, start + offset, _nbytes(name, shape, kind, path))
            if info.offset + info.nbytes > size:
                raise CheckpointError(
                    f"{path}: truncated: tensor {name!r} ends at byte {info.offset + info.nbytes} "
                    f"but the file has {size}; re-download it"
                )
            self.tensors[name] = info

    @staticmethod
    def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string()
        dims = [cur.scalar(10) for _ in range(cur.scalar(4))]
        kind, offset = cur.scalar(4), cur.scalar(10)
        return name, tuple(reversed(dims)), kind, offset

    def type_name(self, name: str) -> str:
        return _type_name(self.tensors[name].ggml_type)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored: (rows..., bytes per row) uint8, memory-mapped."""
        info = self.tensors[name]
        return self._map[info.offset : info.offset + info.nbytes].reshape(*info.shape[:-1], -1)

    def release(self, name: str) -> None:
        """Drop this process's mapping of the tensor's pages (the file stays in the page
        cache): once its blocks have been copied where they will be used, they need not count
        in the process's resident memory."""
        info = self.tensors[name]
        page = mmap.PAGESIZE
        start = -(-info.offset // page) * page
        end = (info.offset + info.nbytes) // page * page
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def read(self, name: str, part: int | None = None) -> torch.Tensor:
        """The tensor on the CPU (or its `part` along the first axis: one expert of a stack):
        F32/F16/BF16 as stored, block formats dequantized to float32. A copy: the file's pages
        it was read from are released (a float model's load then holds its weights once, not
        once more in mapped pages until the file is closed)."""
        import torch
        from gguf import GGMLQuantizationType as T
        from gguf.quants import dequantize

        info = self.tensors[name]
        rows = self.raw(name)  # (..., bytes per row)
        shape = info.shape
        if part is not None:
            rows, shape = rows[part], shape[1:]
        kind = T(info.ggml_type)
        if kind in (T.F32, T.F16, T.BF16):
            dtype = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.int16}[kind]
            out = torch.from_numpy(rows.view(dtype).reshape(shape).copy())
            out = out.view(torch.bfloat16) if kind == T.BF16 else out
        else:
            out = torch.from_numpy(dequantize(rows, kind))
        self.release(name)
        return out

    def close(self) -> None:
        """Forget the mapping; it is unmapped once no array made from it is left."""
        self._map = self._mmap = None


def _type_name(kind: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"ggml type {kind}"


@functools.cache
def can_dequantize(kind: int) -> bool:
    """Whether the installed `gguf` package turns this tensor type into floats."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType(kind)
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except (ValueError, KeyError, NotImplementedError):
        return False
    return True


def _nbytes(name: str, shape: tuple[int, ...], kind: int, path: Path) -> int:
    """Bytes of a tensor; its type must be one the `gguf` package can dequantize."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if not can_dequantize(kind):
        ok = ", ".join(t.name for t in GGMLQuantizationType if can_dequantize(t))
        raise CheckpointError(
            f"{path}: tensor {name!r} is stored as {_type_name(kind)}, which the installed gguf "
            f"package cannot dequantize (it can: {ok}); use a file quantized to one of those"
        )
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    if not shape or shape[-1] % block:
        raise CheckpointError(
            f"{path}: tensor {name!r} has shape {list(shape)}, whose rows do not split into "
            f"{_type_name(kind)} blocks of {block}; the file is corrupt"
        )
    return math.prod(shape) // block * type_size
