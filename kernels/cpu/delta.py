"""The C view of a gated DeltaNet layer for the fused CPU step (kernels/cpu/delta.c, step.h's
zdelta_t): its projections, conv filters, decay parameters and norm, and its cache (the conv
window and the state)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu.build import MAX_ROWS
from kernels.cpu.views import F32, I64, PTR, CLinear, conv_cache_ok, is_fp32, linear_view


class CDelta(ctypes.Structure):  # step.h's zdelta_t
    _fields_ = [
        ("in_proj", CLinear), ("out_proj", CLinear),
        *((name, I64) for name in ("hk", "hv", "dk", "dv", "kernel", "grouped")),
        ("conv_w", PTR), ("neg_a", PTR), ("dt_bias", PTR), ("norm", PTR), ("eps", F32),
        ("conv", PTR), ("state", PTR), ("conv_sb", I64), ("state_sb", I64),
        ("conv_half", I64), ("scratch", PTR),
    ]  # fmt: skip


@dataclass
class Delta:
    """A gated DeltaNet layer the C step takes in place of attention (delta.c): in_proj
    (its rows q|k|v|z|b|a, or `grouped` per key head as Qwen3-Next stores them) and out_proj,
    fp32 or `BlockWeight` / `QuantStack`; the conv's filters (conv_dim, K), -exp(A_log) and
    dt_bias (Hv,), the gated RMSNorm's weight (Dv,) and eps, all fp32; its cache: the conv
    window (B, conv_dim, K - 1) fp32 or fp16 and the state (B, Hv, Dk, Dv) fp32."""

    in_proj: object
    grouped: bool
    out_proj: object
    conv: torch.Tensor
    neg_a: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    eps: float
    conv_state: torch.Tensor
    state: torch.Tensor
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int


DELTA_MAX_DIM = 512  # as step.h


def _delta_rows(d: Delta) -> tuple[int, int, int]:
    """in_proj's rows, the conv's channels (q|k|v) and o's values of a delta layer."""
    kd, vd = d.k_heads * d.k_dim, d.v_heads * d.v_dim
    return 2 * kd + 2 * vd + 2 * d.v_heads, 2 * kd + vd, vd


def delta_scratch(layers: list[Delta]) -> torch.Tensor:
    """step.h's zdelta_t.scratch: MAX_ROWS rows of in_proj's output, the conv's and o."""
    n = max((sum(_delta_rows(d)) for d in layers), default=0)
    return torch.zeros(MAX_ROWS * n)


def delta_view(d: Delta, hidden: int, scratch: torch.Tensor, keep: list) -> CDelta | None:
    """step.h's zdelta_t of d, kept alive in `keep`; None where the C step cannot take
    it. scratch: `delta_scratch`'s, shared by the layers (they run one by one)."""
    n_in, conv_dim, vd = _delta_rows(d)
    k = d.conv.shape[-1]
    lin = [linear_view(d.in_proj, None, keep), linear_view(d.out_proj, None, keep)]
    want = (n_in, hidden)
    if any(x is None for x in lin) or want != (lin[0].N, lin[1].N):
        return None
    ks = [p.K for x in lin for p in x.part[: x.parts]]
    if ks != [hidden] * lin[0].parts + [vd] * lin[1].parts:
        return None
    half = d.conv_state.dtype == torch.float16
    shapes = [
        (d.conv, (conv_dim, k)), (d.neg_a, (d.v_heads,)), (d.dt_bias, (d.v_heads,)),
        (d.norm, (d.v_dim,)), (d.state[0], (d.v_heads, d.k_dim, d.v_dim)),
    ]  # fmt: skip
    if not all(is_fp32(t) and t.shape == shape for t, shape in shapes):
        return None
    if not conv_cache_ok(d.conv_state, conv_dim, k):
        return None
    if max(d.k_dim, d.v_dim) > DELTA_MAX_DIM or d.v_heads % d.k_heads or not is_fp32(d.state):
        return None
    z = CDelta(in_proj=lin[0], out_proj=lin[1], hk=d.k_heads, hv=d.v_heads, dk=d.k_dim,
               dv=d.v_dim, kernel=k, grouped=d.grouped, eps=d.eps, conv_half=half)  # fmt: skip
    z.conv_w, z.neg_a, z.dt_bias, z.norm = (
        t.data_ptr() for t in (d.conv, d.neg_a, d.dt_bias, d.norm)
    )
    z.conv, z.state, z.scratch = d.conv_state.data_ptr(), d.state.data_ptr(), scratch.data_ptr()
    z.conv_sb, z.state_sb = d.conv_state.stride(0), d.state.stride(0)
    keep.append((d, z))
    return z
