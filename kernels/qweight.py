"""Quantized weights: a (out, in) matrix kept as integer codes with per-group scales.

One layout serves every format, so one kernel family serves them all:

    w[n, k] = scale(n, g) * (code[n, k] - offset) + minimum(n, g),   g = k // group

- `codes`: int8 (out, in) for 5-, 6- and 8-bit formats (widened to a byte), or uint8
  (out, in // 2) for 4-bit ones: in each group of 32 columns, byte j holds column j in its low
  nibble and column j + 16 in its high nibble (GGML's Q4_0 / Q4_1 order).
- `scales`: (out, in // group), fp16 or fp32; for the K-quants a small integer per group that a
  fp16 `d` per 256-column super-block multiplies: scale = float(d) * float(sub-scale), in fp32.
- `mins` (optional): the same two forms, with `dmin`.

Block-scaled fp8 (DeepSeek-V3/R1's checkpoints, `fp8_format`) uses the same layout with `codes`
the float8_e4m3fn bytes (uint8 (out, in)) and fp32 `scales` (out, ceil(in / group)): each
checkpoint block's scale repeated over its rows (exact), no offset or minimum:
w[n, k] = float32(fp8[n, k]) * scale(n, k // group), DeepSeek's `weight_dequant` bit for bit.

MXFP4 (gpt-oss's experts, GGML type 39) packs its e2m1 codes as the 4-bit formats do and keeps
one e8m0 exponent per 32 columns as uint8 `scales`: w[n, k] = E2M1[code] * 2^(e - 128), with
E2M1 twice the e2m1 values (ggml's kvalues_mxfp4), one exact fp32 product: the `gguf` package's
floats bit for bit (its code 8 is +0.0; transformers' table has -0.0 there, equal in value).

GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4) are repacked into this layout
losslessly by plugins/formats/gguf_quant.py, and `dequantize` reproduces the `gguf` package's
floats bit for bit (the same fp32 products and sums, in the same order); `quantize` makes int8 /
int4 weights from floats at load time. `kernels.linear` dispatches on the `QuantWeight` type.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class QFormat:
    name: str
    bits: int  # 4: two codes per byte; 5, 6, 8: one int8 code per weight
    group: int  # columns per scale (0: the whole row, per channel)
    offset: int = 0  # subtracted from each code
    minimum: bool = False  # a per-group additive term
    superblock: int = 0  # K-quants: fp16 d (and dmin) per this many columns
    fp8: bool = False  # codes are float8_e4m3fn bytes, not integers
    mx: bool = False  # codes are e2m1 (MXFP4), scales uint8 e8m0 exponents

    @property
    def packed(self) -> bool:
        return self.bits == 4

    def group_of(self, in_features: int) -> int:
        return self.group or in_features


FORMATS = {
    f.name: f
    for f in (
        QFormat("q8_0", 8, 32),
        QFormat("q4_0", 4, 32, offset=8),
        QFormat("q4_1", 4, 32, minimum=True),
        QFormat("q5_0", 8, 32),  # codes stored as code - 16
        QFormat("q5_1", 8, 32, minimum=True),
        QFormat("q4_k", 4, 32, minimum=True, superblock=256),
        QFormat("q5_k", 8, 32, minimum=True, superblock=256),
        QFormat("q6_k", 8, 16, superblock=256),  # codes stored as code - 32
        QFormat("int8", 8, 32),  # quantized at load: symmetric, fp16 scale per 32 (as Q8_0)
        QFormat("int4", 4, 32, minimum=True),  # quantized at load: asymmetric, fp16 scale + min
        QFormat("mxfp4", 4, 32, mx=True),  # e2m1 codes, an e8m0 scale per 32 (gpt-oss)
    )
}
# twice the e2m1 values of MXFP4's codes (ggml's kvalues_mxfp4): integers, exact in any dtype
E2M1 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

FP8 = "fp8_e4m3"  # a checkpoint's block-scaled fp8, kept on GPUs that compute in it


def fp8_format(group: int) -> QFormat:
    """The kept form of block-scaled fp8 with `group` columns per scale (the checkpoint's
    weight_block_size[1]: DeepSeek's 128); in_features need not be a multiple of it."""
    return QFormat(FP8, 8, group, fp8=True)


class QuantizedWeight(nn.Module):
    """What layers read of a weight, whatever holds it: its shape, device and resident bytes;
    `dtype` is the float dtype the model computes in (what the weight stands for)."""

    shape: tuple[int, int]
    dtype: torch.dtype

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers())


class QuantWeight(QuantizedWeight):
    """A quantized (out_features, in_features) weight: its tensors are buffers, so `.to()`,
    `state_dict` and the strict loader treat them like any other."""

    def __init__(
        self,
        fmt: QFormat,
        shape: tuple[int, int],
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None = None,
        d: torch.Tensor | None = None,
        dmin: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.fmt, self.shape, self.dtype = fmt, tuple(shape), dtype
        for name, t in (("codes", codes), ("scales", scales), ("mins", mins), ("d", d)):
            self.register_buffer(name, t)
        self.register_buffer("dmin", dmin)

    def extra_repr(self) -> str:
        return f"{self.fmt.name}, shape={self.shape}"

    def group_scales(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """fp32 (rows, groups): each group's scale (MXFP4: half of it, see `e8m0_half`)."""
        if self.fmt.mx:
            return e8m0_half(self.scales[rows])
        return _two_level(self.scales[rows], self.d, rows, self)

    def group_mins(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor | None:
        """fp32 (rows, groups): each group's additive term, or None."""
        if self.mins is None:
            return None
        return _two_level(self.mins[rows], self.dmin, rows, self)

    def int_codes(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """(rows, in_features) codes as int16 (offset not yet subtracted)."""
        c = self.codes[rows]
        if not self.fmt.packed:
            return c.to(torch.int16)
        c = c.view(*c.shape[:-1], -1, 16).to(torch.int16)  # (..., groups of 32, 16 bytes)
        return torch.cat([c & 15, c >> 4], dim=-1).flatten(-2)

    def dequantize(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """The float32 weight (or some of its rows): the reference every kernel is tested
        against, equal bit for bit to the `gguf` package's dequantization of the same blocks."""
        fmt = self.fmt
        if fmt.fp8:  # float32(fp8) * scale: one product, as DeepSeek's weight_dequant
            s = self.scales[rows].float().repeat_interleave(fmt.group, dim=-1)
            return self.codes[rows].view(torch.float8_e4m3fn).float() * s[..., : self.in_features]
        if fmt.mx:
            return mx_dequantize(self.codes[rows], self.scales[rows])
        q = self.int_codes(rows)
        if fmt.offset:
            q = q - fmt.offset
        q = q.float().unflatten(-1, (-1, fmt.group_of(self.in_features)))
        w = self.group_scales(rows)[..., None] * q  # two roundings, as numpy does: no fma
        mins = self.group_mins(rows)
        if mins is not None:
            w = w + mins[..., None]
        return w.flatten(-2)

    def select_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: the float32 rows `ids` (any shape) -> (*ids.shape, in_features)."""
        return self.dequantize(ids.reshape(-1)).view(*ids.shape, self.in_features)


def _two_level(small: torch.Tensor, big: torch.Tensor | None, rows, w: QuantWeight) -> torch.Tensor:
    if big is None:
        return small.float()
    per = w.fmt.superblock // w.fmt.group  # groups per super-block
    return big[rows].float().repeat_interleave(per, dim=-1) * small.float()


class QuantStack(QuantizedWeight):
    """Weights of different formats stacked along the output dimension: a fused q|k|v whose v
    a Q4_K_M file keeps in Q6_K. `kernels.linear` runs each part and concatenates."""

    def __init__(self, parts: list[QuantWeight]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.shape = (sum(p.out_features for p in parts), parts[0].in_features)
        self.dtype = parts[0].dtype

    def extra_repr(self) -> str:
        return f"shape={self.shape}"

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])[rows]


class QuantExperts(QuantizedWeight):
    """E fp8 or MXFP4 weights of one shape stacked, (E, out, in): a MoE layer's routed experts
    kept as their checkpoint stores them. fp8: codes uint8 (E, out, in), scales fp32 (E, out,
    ceil(in / group)); MXFP4: codes uint8 (E, out, in / 2), scales uint8 (E, out, in / 32);
    each expert's as in `QuantWeight`. `kernels.moe_experts` reads them."""

    def __init__(self, parts: list[QuantWeight]):
        super().__init__()
        first = parts[0]
        ok = first.fmt.fp8 or first.fmt.mx
        if not ok or any(p.fmt != first.fmt or p.shape != first.shape for p in parts):
            raise ValueError("QuantExperts stacks fp8 or mxfp4 weights of one format and shape")
        self.fmt, self.dtype = first.fmt, first.dtype
        self.shape = (len(parts), *first.shape)
        self.register_buffer("codes", torch.stack([p.codes for p in parts]))
        self.register_buffer("scales", torch.stack([p.scales for p in parts]))

    def extra_repr(self) -> str:
        return f"{self.fmt.name}, shape={self.shape}"

    def dequantize(self, experts: int | slice = slice(None)) -> torch.Tensor:
        """The float32 weights of one expert (out, in), or of a slice of them: float32(fp8) *
        scale, DeepSeek's weight_dequant bit for bit; MXFP4 as `QuantWeight.dequantize`."""
        if self.fmt.mx:
            return mx_dequantize(self.codes[experts], self.scales[experts])
        s = self.scales[experts].repeat_interleave(self.fmt.group, dim=-1)
        return self.codes[experts].view(torch.float8_e4m3fn).float() * s[..., : self.shape[2]]


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 exponents -> fp32 2^(e - 128), built from the bits as ggml's
    ggml_e8m0_to_fp32_half builds it (e < 2: the subnormals 2^-128, 2^-127)."""
    e = e.to(torch.int32)
    return torch.where(e < 2, 0x00200000 << e.clamp(max=1), (e - 1) << 23).view(torch.float32)


def mx_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 codes (..., in / 2) uint8 (this module's nibble order) and e8m0 scales (..., in /
    32) -> fp32 (..., in): E2M1[code] * 2^(e - 128), one product, as the `gguf` package."""
    c = codes.view(*codes.shape[:-1], -1, 16)
    q = torch.cat([c & 15, c >> 4], dim=-1).int()  # (..., groups, 32)
    values = torch.tensor(E2M1, dtype=torch.float32, device=codes.device)[q]
    return (e8m0_half(scales)[..., None] * values).flatten(-2)


def cat_rows(parts: list[QuantWeight]) -> QuantWeight | QuantStack:
    """Stack weights along the output dimension (fused q|k|v, gate|up): one `QuantWeight`
    when they share a format, a `QuantStack` otherwise."""
    fmt, first = parts[0].fmt, parts[0]
    if len(parts) == 1:
        return first
    if any(p.fmt != fmt for p in parts):  # neighbours of one format merged: q|k, then v
        runs = [list(g) for _, g in itertools.groupby(parts, key=lambda p: p.fmt)]
        return QuantStack([cat_rows(run) for run in runs])
    out = sum(p.out_features for p in parts)

    def cat(name: str) -> torch.Tensor | None:
        ts = [getattr(p, name) for p in parts]
        return None if ts[0] is None else torch.cat(ts)

    return QuantWeight(
        fmt,
        (out, first.in_features),
        cat("codes"),
        cat("scales"),
        cat("mins"),
        cat("d"),
        cat("dmin"),
        first.dtype,
    )


# --- quantize at load (int8 / int4) ----------------------------------------------------------
def quantize(w: torch.Tensor, kind: str) -> QuantWeight:
    """Quantize a float (out, in) weight in groups of 32 columns with fp16 scales: `int8`
    symmetric (GGML's Q8_0; per-row scales, as gpt-fast's int8, lost 6.5% of SmolLM2's top-1
    tokens), `int4` asymmetric with an fp16 minimum (GGML's Q4_1)."""
    fmt = FORMATS[kind]
    w = w.detach().float()
    out, inp = w.shape
    if inp % 32:
        raise ValueError(f"{kind} needs in_features divisible by 32, got {inp}")
    g = w.view(out, inp // 32, 32)
    if kind == "int8":
        scale = (g.abs().amax(-1) / 127).to(torch.float16)
        inv = torch.where(scale == 0, 0, 1 / scale.float())
        codes = torch.round(g * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantWeight(fmt, (out, inp), codes.view(out, inp), scale)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).to(torch.float16)
    mins = lo.to(torch.float16)
    inv = torch.where(scale == 0, 0, 1 / scale.float())
    q = torch.round((g - mins.float()[..., None]) * inv[..., None]).clamp(0, 15)
    return QuantWeight(fmt, (out, inp), pack_nibbles(q.view(out, inp)), scale, mins)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(rows, in) codes in 0..15 -> (rows, in // 2) uint8 in this module's nibble order."""
    g = q.to(torch.uint8).view(*q.shape[:-1], -1, 32)
    return (g[..., :16] | (g[..., 16:] << 4)).flatten(-2)
