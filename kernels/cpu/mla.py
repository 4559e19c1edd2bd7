"""The C view of DeepSeek's multi-head latent attention for the fused CPU step (kernels/cpu/mla.c,
step.h's zmla_t): its projections, norms and absorbed kv_b, and its latent and k_pe caches."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu.views import F32, I64, PTR, CLinear, cache_ok, is_fp32, linear_view, norm_ok


class CMla(ctypes.Structure):  # step.h's zmla_t
    _fields_ = [
        *((name, I64) for name in ("heads", "rank", "dn", "dr", "dv", "q_rank")),
        ("q", CLinear), ("q_a", CLinear), ("kv_a", CLinear), ("q_norm", PTR), ("kv_norm", PTR),
        ("q_eps", F32), ("kv_eps", F32), ("scale", F32), ("kv_b", PTR),
        ("latent", PTR), ("k_pe", PTR),
        *((name, I64) for name in ("lsb", "lss", "psb", "pss", "half", "rope_half",
                                    "interleaved")),
    ]  # fmt: skip


@dataclass
class Latent:
    """An MLA attention the C step takes (step.h's zmla_t): q = q(x), or q(rms_norm(q_a(x)))
    where `q_a` is given; kv_a(x) = [latent (rank) | k_pe (rope)]; kv_b (heads (nope + v), rank)
    fp32, absorbed; caches latent (B, S, rank) and k_pe (B, S, rope), fp32 or fp16. Weights fp32
    or `BlockWeight`; norms: (weight, eps)."""

    heads: int
    rank: int
    nope: int
    rope: int
    v: int
    q: object
    q_a: object | None
    q_a_bias: torch.Tensor | None
    q_norm: tuple[torch.Tensor, float] | None
    kv_a: object
    kv_a_bias: torch.Tensor | None
    kv_norm: tuple[torch.Tensor, float]
    kv_b: torch.Tensor
    latent: torch.Tensor
    k_pe: torch.Tensor
    scale: float


def mla_view(m: Latent, rope: tuple[int, bool], hidden: int, keep: list) -> CMla | None:
    """step.h's zmla_t of m, kept alive in `keep`; None where the C step cannot take it.
    rope: (half of the rope dims of the step's table, interleaved)."""
    if m.q_a is not None and m.q_norm is None:
        return None
    q_rank = 0 if m.q_a is None else m.q_norm[0].shape[0]
    q = linear_view(m.q, None, keep)
    q_a = linear_view(m.q_a, m.q_a_bias, keep) if q_rank else CLinear()
    kv_a = linear_view(m.kv_a, m.kv_a_bias, keep)
    shapes = [
        (q, m.heads * (m.nope + m.rope), q_rank or hidden),
        (q_a, q_rank, hidden if q_rank else 0),
        (kv_a, m.rank + m.rope, hidden),
    ]
    for lin, n, k in shapes:
        if lin is None or n != lin.N or any(k != lin.part[i].K for i in range(lin.parts)):
            return None
    half = m.latent.dtype == torch.float16
    caches = cache_ok(m.latent, 3, half) and cache_ok(m.k_pe, 3, half)
    if not caches or m.latent.shape != (*m.k_pe.shape[:2], m.rank) or m.k_pe.shape[2] != m.rope:
        return None
    if not (is_fp32(m.kv_b) and m.kv_b.shape == (m.heads * (m.nope + m.v), m.rank)):
        return None
    if not norm_ok(m.kv_norm, m.rank) or (q_rank and not norm_ok(m.q_norm, q_rank)):
        return None
    if 2 * rope[0] != m.rope:
        return None
    e = CMla(heads=m.heads, rank=m.rank, dn=m.nope, dr=m.rope, dv=m.v, q_rank=q_rank, q=q)
    e.q_a, e.kv_a, e.kv_b = q_a, kv_a, m.kv_b.data_ptr()
    if q_rank:
        e.q_norm, e.q_eps = m.q_norm[0].data_ptr(), m.q_norm[1]
    e.kv_norm, e.kv_eps, e.scale = m.kv_norm[0].data_ptr(), m.kv_norm[1], m.scale
    e.latent, e.k_pe, e.half = m.latent.data_ptr(), m.k_pe.data_ptr(), half
    e.lsb, e.lss = m.latent.stride()[:2]
    e.psb, e.pss = m.k_pe.stride()[:2]
    e.rope_half, e.interleaved = rope
    keep.append((m.kv_b, m.latent, m.k_pe, m.q_norm, m.kv_norm, e))
    return e
