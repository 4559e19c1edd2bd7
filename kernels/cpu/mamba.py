"""The C view of a Mamba2 layer for the fused CPU step (kernels/cpu/mamba.c, step.h's
zmamba_t): its projections, conv filters and bias, dt's bias and clamp, A, D and the grouped
norm, and its cache (the conv window and the state)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu.build import MAX_ROWS
from kernels.cpu.views import F32, I64, PTR, CLinear, address, conv_cache_ok, is_fp32, linear_view


class CConv(ctypes.Structure):  # step.h's zconv_t
    _fields_ = [("w", PTR), ("bias", PTR), ("cache", PTR), ("kernel", I64), ("sb", I64),
                ("half", I64)]  # fmt: skip


class CMamba(ctypes.Structure):  # step.h's zmamba_t
    _fields_ = [
        ("in_proj", CLinear), ("out_proj", CLinear),
        *((name, I64) for name in ("heads", "p", "groups", "n")),
        ("conv", CConv), ("neg_a", PTR), ("dt_bias", PTR), ("d", PTR),
        ("dt_min", F32), ("dt_max", F32), ("norm", PTR), ("eps", F32),
        ("state", PTR), ("state_sb", I64), ("scratch", PTR),
    ]  # fmt: skip


@dataclass
class Mamba:
    """A Mamba2 layer the C step takes in place of attention (mamba.c): in_proj (its rows
    z | x | B | C | dt) and out_proj with their biases, fp32 or `BlockWeight` / `QuantStack`;
    the conv's filters (conv_dim, K) and bias (conv_dim,) or None, -exp(A_log), dt_bias and D
    (heads,), dt's clamp, the grouped RMSNorm's weight (heads * head_dim,) and eps, all fp32;
    its cache: the conv window (B, conv_dim, K - 1) fp32 or fp16 and the state
    (B, heads, head_dim, state) fp32."""

    in_proj: object
    in_bias: torch.Tensor | None
    out_proj: object
    out_bias: torch.Tensor | None
    conv: torch.Tensor
    conv_bias: torch.Tensor | None
    neg_a: torch.Tensor
    dt_bias: torch.Tensor
    d: torch.Tensor
    dt_limit: tuple[float, float]
    norm: torch.Tensor
    eps: float
    conv_state: torch.Tensor
    state: torch.Tensor
    heads: int
    head_dim: int
    groups: int
    state_dim: int


def _rows(m: Mamba) -> tuple[int, int, int]:
    """in_proj's rows, the conv's channels (x|B|C) and the gated output's values."""
    inner = m.heads * m.head_dim
    conv_dim = inner + 2 * m.groups * m.state_dim
    return inner + conv_dim + m.heads, conv_dim, inner


def mamba_scratch(layers: list[Mamba]) -> torch.Tensor:
    """step.h's zmamba_t.scratch: MAX_ROWS rows of in_proj's output, the conv's and y."""
    n = max((sum(_rows(m)) for m in layers), default=0)
    return torch.zeros(MAX_ROWS * n)


def mamba_view(m: Mamba, hidden: int, scratch: torch.Tensor, keep: list) -> CMamba | None:
    """step.h's zmamba_t of m, kept alive in `keep`; None where the C step cannot take it.
    scratch: `mamba_scratch`'s, shared by the layers (they run one by one)."""
    n_in, conv_dim, inner = _rows(m)
    k = m.conv.shape[-1]
    lin = [linear_view(m.in_proj, m.in_bias, keep), linear_view(m.out_proj, m.out_bias, keep)]
    if any(x is None for x in lin) or (n_in, hidden) != (lin[0].N, lin[1].N):
        return None
    ks = [p.K for x in lin for p in x.part[: x.parts]]
    if ks != [hidden] * lin[0].parts + [inner] * lin[1].parts:
        return None
    h = m.heads
    shapes = [
        (m.conv, (conv_dim, k)), (m.neg_a, (h,)), (m.dt_bias, (h,)), (m.d, (h,)),
        (m.norm, (inner,)), (m.state[0], (h, m.head_dim, m.state_dim)),
    ]  # fmt: skip
    if m.conv_bias is not None:
        shapes.append((m.conv_bias, (conv_dim,)))
    if not all(is_fp32(t) and t.shape == shape for t, shape in shapes):
        return None
    if not conv_cache_ok(m.conv_state, conv_dim, k) or not is_fp32(m.state):
        return None
    if h % m.groups:  # (the grouped norm then splits inner = h * head_dim alike)
        return None
    half = m.conv_state.dtype == torch.float16
    conv = CConv(w=m.conv.data_ptr(), bias=address(m.conv_bias), cache=m.conv_state.data_ptr(),
                 kernel=k, sb=m.conv_state.stride(0), half=half)  # fmt: skip
    lo, hi = m.dt_limit
    z = CMamba(in_proj=lin[0], out_proj=lin[1], heads=h, p=m.head_dim, groups=m.groups,
               n=m.state_dim, conv=conv, dt_min=lo, dt_max=hi, eps=m.eps)  # fmt: skip
    z.neg_a, z.dt_bias, z.d, z.norm = (t.data_ptr() for t in (m.neg_a, m.dt_bias, m.d, m.norm))
    z.state, z.state_sb, z.scratch = m.state.data_ptr(), m.state.stride(0), scratch.data_ptr()
    keep.append((m, z))
    return z
