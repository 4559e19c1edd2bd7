"""GGML block weights on CPUs: a GGUF file's blocks (or int8 / int4 weights quantized at load),
repacked losslessly (kernels/cpu/qformats.c) for kernels/cpu/qdot.c's products.

`BlockWeight` holds an (out, in) weight as the file's blocks reordered in groups of 16 rows:
per group, the rows' block headers side by side, then their codes interleaved 4 bytes per row,
so that one 64-byte vector holds 4 codes of each row and meets 4 codes of x broadcast to every
lane in one multiply-add (qdot.c explains why, qformats.h details the layout). The bytes are
the file's, the same number of them (plus at most 63 per group of 16 rows, and zero rows
completing the last group); `dequantize` gives the `gguf` package's floats bit for bit.
Products quantize x to 8-bit blocks of 32 (one fp32 scale each), and their results are the
same for a row of x whatever else is in the batch.

On GPUs the same tensors become `kernels.qweight.QuantWeight`s (Triton's layout) instead.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu.build import QWeightView, library
from kernels.qweight import QuantizedWeight, QuantWeight


@dataclass(frozen=True)
class BlockFormat:
    name: str  # lower-case GGML name: q4_k
    type: int  # GGML's type id
    values: int  # columns per block
    nbytes: int  # bytes per block


FORMATS = {
    f.name: f
    for f in (
        BlockFormat("q4_0", 2, 32, 18),
        BlockFormat("q4_1", 3, 32, 20),
        BlockFormat("q5_0", 6, 32, 22),
        BlockFormat("q5_1", 7, 32, 24),
        BlockFormat("q8_0", 8, 32, 34),
        BlockFormat("q4_k", 12, 256, 144),
        BlockFormat("q5_k", 13, 256, 176),
        BlockFormat("q6_k", 14, 256, 210),
        BlockFormat("mxfp4", 39, 32, 17),  # e2m1 codes, an e8m0 scale per 32 (gpt-oss)
    )
}
# formats quantized at load (kernels.qweight.quantize) -> the GGML blocks they are
AT_LOAD = {"int8": "q8_0", "int4": "q4_1"}


class BlockWeight(QuantizedWeight):
    """A quantized (out_features, in_features) weight in GGML blocks, repacked (`repack`);
    its one buffer, `blocks`, is what `.to()`, `state_dict` and the loader see."""

    def __init__(self, kind: str, shape: tuple[int, int], blocks: torch.Tensor,
                 dtype: torch.dtype = torch.float32):  # fmt: skip
        super().__init__()
        self.fmt, self.shape, self.dtype = FORMATS[kind], tuple(shape), dtype
        self.register_buffer("blocks", blocks)

    def extra_repr(self) -> str:
        return f"{self.fmt.name}, shape={self.shape}, repacked"

    def c_view(self):
        """The C struct the kernels read (kernels/cpu/zoo_cpu.h's qweight_t), kept while the
        buffer stays the same tensor."""
        cached = self.__dict__.get("_c_view")
        if cached is not None and cached[0] is self.blocks:
            return cached[1]
        view = QWeightView(self.blocks.data_ptr(), *self.shape, self.fmt.type)
        self.__dict__["_c_view"] = (self.blocks, view)
        return view

    def dequantize(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """The float32 weight (or some of its rows): the `gguf` package's values bit for bit."""
        ids = torch.arange(self.shape[0])[rows] if isinstance(rows, slice) else rows
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < self.shape[0]:
            raise IndexError(f"rows out of range for a weight of {self.shape[0]} rows")
        out = torch.empty(len(ids), self.shape[1])
        library().zoo_dequantize_rows(
            ctypes.byref(self.c_view()), ids.data_ptr(), len(ids), out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def select_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: the float32 rows `ids` (any shape) -> (*ids.shape, in_features)."""
        return self.dequantize(ids.reshape(-1)).view(*ids.shape, self.shape[1])


class BlockExperts(QuantizedWeight):
    """A MoE layer's E routed experts kept in GGML blocks, (E, out, in): one weight per expert
    (a `BlockWeight`, or a `QuantStack` of them where an expert's gate and up differ in
    format), each repacked as a `BlockWeight` is. Only the experts a token chose are read."""

    def __init__(self, experts: list[QuantizedWeight]):
        super().__init__()
        self.experts = torch.nn.ModuleList(experts)
        first = experts[0]
        self.shape = (len(experts), *first.shape)
        self.dtype = first.dtype
        parts = getattr(first, "parts", [first])
        self.fmt = parts[0].fmt  # the first part's, for listings (`zoo info`)

    def extra_repr(self) -> str:
        return f"{self.fmt.name}, shape={self.shape}, repacked"

    def __getitem__(self, e: int) -> QuantizedWeight:
        return self.experts[e]

    def dequantize(self, experts: int = 0) -> torch.Tensor:
        """Expert e's float32 (out, in) weight: the `gguf` package's values bit for bit."""
        return self.experts[experts].dequantize()


def available() -> bool:
    """Whether block weights can be made here (the C library builds)."""
    return library() is not None


def repacked_bytes(kind: str, rows: int, cols: int) -> int:
    """Bytes a (rows, cols) weight of `kind` takes repacked."""
    return int(library().zoo_repacked_bytes(FORMATS[kind].type, rows, cols))


def repack(kind: str, sources: list[np.ndarray], shape: tuple[int, int],
           orders: list[np.ndarray | None] | None = None) -> BlockWeight:  # fmt: skip
    """A `BlockWeight` of the (rows, bytes per row) uint8 arrays `sources` (a file's blocks,
    memory-mapped or not) stacked along the output dimension; orders[i], where given, lists
    the source row of each output row of part i. The sources are read once, in the C kernel."""
    fmt = FORMATS[kind]
    n, k = sum(s.shape[0] for s in sources), shape[1]
    per_row = k // fmt.values * fmt.nbytes
    addresses = []
    for i, src in enumerate(sources):
        if src.dtype != np.uint8 or src.ndim != 2 or src.shape[1] != per_row:
            raise ValueError(f"{kind} rows of {k} values are {per_row} bytes, got {src.shape}")
        if not src.flags.c_contiguous:
            raise ValueError("source rows must be contiguous")
        order = orders[i] if orders else None
        at = np.arange(src.shape[0], dtype=np.int64) if order is None else order.astype(np.int64)
        addresses.append(src.ctypes.data + at * per_row)
    rows = np.ascontiguousarray(np.concatenate(addresses))
    lib = library()
    out = torch.empty(int(lib.zoo_repacked_bytes(fmt.type, n, k)), dtype=torch.uint8)
    lib.zoo_repack(fmt.type, rows.ctypes.data, n, k, out.data_ptr(), torch.get_num_threads())
    return BlockWeight(kind, (n, k), out)


def from_quant(w: QuantWeight) -> BlockWeight:
    """An int8 / int4 weight quantized at load (kernels.qweight.quantize: GGML's Q8_0 / Q4_1
    values) as the same blocks, repacked."""
    kind = AT_LOAD[w.fmt.name]
    n, k = w.shape
    d = w.scales.to(torch.float16).view(torch.uint8).view(n, k // 32, 2)
    parts = [d]
    if kind == "q4_1":
        parts.append(w.mins.to(torch.float16).view(torch.uint8).view(n, k // 32, 2))
        parts.append(w.codes.view(n, k // 32, 16))
    else:
        parts.append(w.codes.view(torch.uint8).view(n, k // 32, 32))
    raw = torch.cat(parts, dim=-1).reshape(n, -1).numpy()
    out = repack(kind, [np.ascontiguousarray(raw)], (n, k))
    out.dtype = w.dtype
    return out
