"""GGML block formats -> the core's `QuantWeight` layout (kernels/qweight.py), losslessly.

Each block type's bytes are split into codes, scales and minimums; only the nibble order of the
K-quants changes (GGML packs two 32-column sub-blocks into one run of 32 bytes, the core packs
each 32-column group into its own 16 bytes). Layouts: ggml-common.h (block_q4_0, block_q4_K, ...).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.qweight import FORMATS, QuantWeight, pack_nibbles

QK_K = 256


def _f16(b: np.ndarray) -> torch.Tensor:
    """(..., 2) bytes -> (...) fp16."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0])


def _nibbles(b: np.ndarray) -> np.ndarray:
    """(..., 32 * n / 2) bytes in GGML's order (a run of bytes: low nibbles, then high) -> codes."""
    return np.concatenate([b & 0x0F, b >> 4], axis=-1)


def _bits(b: np.ndarray, width: int, count: int) -> np.ndarray:
    """(..., m) bytes -> (..., count * m): field i of every byte, then field i + 1, ... (GGML's
    qh planes, where column c * m + j takes field c of byte j)."""
    mask = (1 << width) - 1
    return np.concatenate([(b >> (width * i)) & mask for i in range(count)], axis=-1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> (..., 8) each (get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _codes(q: np.ndarray, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(q).reshape(rows, -1))


def repack(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantWeight:
    """`raw`: (out, bytes per row) GGML blocks of type `kind` (lower-case GGML name)."""
    fmt, (out, inp) = FORMATS[kind], shape
    if kind in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1"):
        size = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24}[kind]
        b = raw.reshape(out, inp // 32, size)
        d = _f16(b[..., 0:2])
        mins, at = None, 2
        if kind in ("q4_1", "q5_1"):
            mins, at = _f16(b[..., 2:4]), 4
        if kind == "q8_0":
            return QuantWeight(fmt, shape, _codes(b[..., 2:].view(np.int8), out), d)
        if kind in ("q4_0", "q4_1"):
            return QuantWeight(fmt, shape, _codes(b[..., at:], out), d, mins)
        q = _nibbles(b[..., at + 4 :]) | (_qh5(b[..., at : at + 4]) << 4)
        q = q.astype(np.int8) - (16 if kind == "q5_0" else 0)
        return QuantWeight(fmt, shape, _codes(q, out), d, mins)
    if kind in ("q4_k", "q5_k"):
        size = 144 if kind == "q4_k" else 176
        b = raw.reshape(out, inp // QK_K, size)
        d, dmin = _f16(b[..., 0:2]), -_f16(b[..., 2:4])  # stored negated: w = s * q + (-dm)
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., -128:].reshape(out, inp // QK_K, 4, 32)  # 4 runs of 32 bytes: 64 columns
        q = _nibbles(qs)  # (out, blocks, 4, 64)
        if kind == "q5_k":
            high = _bits(b[..., 16:48], 1, 8).reshape(out, inp // QK_K, 4, 64)
            q = (q | (high << 4)).astype(np.int8)
            codes = _codes(q, out)
        else:
            codes = pack_nibbles(_codes(q, out))
        return QuantWeight(
            fmt,
            shape,
            codes,
            torch.from_numpy(sc.reshape(out, -1)),
            torch.from_numpy(mn.reshape(out, -1)),
            d,
            dmin,
        )
    if kind == "mxfp4":
        b = raw.reshape(out, inp // 32, 17)
        scales = torch.from_numpy(np.ascontiguousarray(b[..., 0]))
        return QuantWeight(fmt, shape, _codes(b[..., 1:], out), scales)
    if kind == "q6_k":
        b = raw.reshape(out, inp // QK_K, 210)
        ql = _nibbles(b[..., 0:128].reshape(out, -1, 2, 64))  # 2 halves of 128 columns
        qh = _bits(b[..., 128:192].reshape(out, -1, 2, 32), 2, 4)
        q = (ql | (qh << 4)).astype(np.int8) - 32
        scales = torch.from_numpy(np.ascontiguousarray(b[..., 192:208]).view(np.int8))
        d = _f16(b[..., 208:210])
        return QuantWeight(fmt, shape, _codes(q, out), scales.reshape(out, -1), None, d)
    raise ValueError(f"no repacking for {kind}")


def _qh5(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: 4 bytes read as a little-endian uint32; column j takes bit j."""
    u = np.ascontiguousarray(qh).view(np.uint32)  # (..., 1)
    return ((u >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


KEPT = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "mxfp4")
