"""Rotary embeddings applied in place to q and k; a program rotates a few tokens of one row.

Half-split pairs (i, i + R/2) (Llama, Qwen); interleaved pairs (2i, 2i+1) (DeepSeek). Only the
first R = 2 * cos.shape[-1] dims rotate (MLA's partial rope); the rest are not touched. cos/sin
carry a batch dim (B or 1), so every row may sit at its own positions. Rounds after every
elementwise op like the reference in q's dtype, so bf16 results match it bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.casting import round_to
from kernels.dispatch import interpreting, require

INTERPRETED = interpreting()
TILE = 4096  # elements of q per program: several tokens when heads x R/2 is small


@triton.jit
def _rotate(base, t_off, stride_h, n_heads, t_mask, o1, o2, col_mask, c, s, BLOCK_H: tl.constexpr):
    """Rotate column pairs (o1, o2) of heads [0, n_heads) for a (BLOCK_T,) tile of tokens."""
    heads = tl.arange(0, BLOCK_H)
    mask = t_mask[:, None, None] & (heads < n_heads)[None, :, None] & col_mask[None, None, :]
    row = base + t_off[:, None, None] + heads[None, :, None] * stride_h  # (BLOCK_T, BLOCK_H, 1)
    p1 = row + o1[None, None, :]
    p2 = row + o2[None, None, :]
    dt = base.dtype.element_ty
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    a1 = round_to(x1 * c, dt).to(tl.float32)
    b1 = round_to(x2 * s, dt).to(tl.float32)
    a2 = round_to(x2 * c, dt).to(tl.float32)
    b2 = round_to(x1 * s, dt).to(tl.float32)
    tl.store(p1, round_to(a1 - b1, dt), mask=mask)
    tl.store(p2, round_to(a2 + b2, dt), mask=mask)


@triton.jit
def _rope_kernel(
    Q,
    K,
    COS,
    SIN,
    n_tokens,
    n_q_heads,
    n_k_heads,
    half,
    sq_b,
    sq_h,
    sq_t,
    sk_b,
    sk_h,
    sk_t,
    sc_b,
    sc_t,
    INTERLEAVED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < n_tokens
    i = tl.arange(0, BLOCK_R)
    col_mask = i < half
    cmask = t_mask[:, None] & col_mask[None, :]
    # (BLOCK_T, 1, BLOCK_R) tables, cast to q's dtype first as the reference does
    dt = Q.dtype.element_ty
    cs = COS + b * sc_b + t[:, None] * sc_t + i[None, :]
    c = round_to(tl.load(cs, mask=cmask, other=0.0).to(tl.float32), dt).to(tl.float32)
    sn = SIN + b * sc_b + t[:, None] * sc_t + i[None, :]
    s = round_to(tl.load(sn, mask=cmask, other=0.0).to(tl.float32), dt).to(tl.float32)
    c = c[:, None, :]
    s = s[:, None, :]
    if INTERLEAVED:
        o1 = 2 * i
        o2 = 2 * i + 1
    else:
        o1 = i
        o2 = i + half
    t64 = t.to(tl.int64)
    q_base = Q + b * sq_b
    k_base = K + b * sk_b
    _rotate(q_base, t64 * sq_t, sq_h, n_q_heads, t_mask, o1, o2, col_mask, c, s, BLOCK_HQ)
    _rotate(k_base, t64 * sk_t, sk_h, n_k_heads, t_mask, o1, o2, col_mask, c, s, BLOCK_HK)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, Hq, T, D) and k (B, Hk, T, D) in place by cos/sin (B or 1, T, R/2).

    q and k may be strided views (e.g. of a fused qkv output) as long as the last dim is
    contiguous; otherwise they are copied, and the rotated copies are returned.
    """
    op = "apply_rope"
    require(q.ndim == 4 and k.ndim == 4, op, f"q {q.shape} and k {k.shape} must be (B, H, T, D)")
    bsz, hq, t, d = q.shape
    require(
        k.shape[0] == bsz and k.shape[2] == t and k.shape[3] == d,
        op,
        f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in B, T or D",
    )
    require(q.dtype == k.dtype, op, f"q is {q.dtype}, k is {k.dtype}")
    half = cos.shape[-1]
    require(
        cos.shape == sin.shape and cos.ndim == 3 and cos.shape[0] in (1, bsz) and cos.shape[1] == t,
        op,
        f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be (1 or {bsz}, {t}, R/2)",
    )
    require(0 < 2 * half <= d, op, f"rotary dims 2*{half} exceed head dim {d}")
    require(cos.device == q.device and k.device == q.device, op, "q, k, cos, sin on one device")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    if bsz * t == 0:
        return q, k
    block_hq, block_r = triton.next_power_of_2(hq), triton.next_power_of_2(half)
    block_t = max(1, min(TILE // (block_hq * block_r), triton.next_power_of_2(t)))
    _rope_kernel[(bsz, triton.cdiv(t, block_t))](
        q,
        k,
        cos,
        sin,
        t,
        hq,
        k.shape[1],
        half,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        cos.stride(0) if cos.shape[0] > 1 else 0,
        cos.stride(1),
        INTERLEAVED=bool(interleaved),
        BLOCK_T=block_t,
        BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_R=block_r,
        num_warps=4,
    )
    return q, k
