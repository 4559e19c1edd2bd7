"""The gated delta rule (gated DeltaNet's linear attention) in Triton: a recurrent kernel for
decode and a chunked one for prefill, both carrying each (row, value head)'s state in registers.

Per token (see kernels/reference.py): S = exp(g) S; u = beta (v - S^T k); S += k u^T;
o = scale * S^T q. One program per (row, value head, block of BV value dims): the state's
columns are independent, so the value dims split across programs.

- `_recurrent_kernel` walks the tokens one by one (decode: T = 1), as fla's fused_recurrent.
- `_chunk_kernel` walks chunks of BT tokens. Within a chunk (G the cumulative log decay from
  its start, S0 the state before it), the new values U solve the unit lower-triangular system
  (I + A) U = beta (V - exp(G) K S0), A_ij = beta_i exp(G_i - G_j) k_i.k_j for j < i, through
  (I + A)^-1 = (I - A)(I + A^2)(I + A^4)... (A is nilpotent), log2(BT) pairs of matmuls;
  then O = exp(G) Q S0 + (Q K^T * decay) U and S = exp(G_end) S0 + (K * exp(G_end - G))^T U:
  matmuls (`tl.dot`) instead of T state updates.
  fla's chunk_gated_delta_rule splits the same steps over several kernels for more
  parallelism on long prompts; here one program keeps its chunk loop (good for the CPU
  interpreter's tests and short prompts, and a baseline to measure fla against).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.casting import mma
from kernels.dispatch import interpreting, require

INTERPRETED = interpreting()
CHUNK = 32  # tokens per chunk (a power of two, >= 16 for tl.dot)


@triton.jit
def _recurrent_kernel(
    Q, K, V, G, BETA, S, OUT,
    T, HV, DK, DV, REP, scale,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    # q, k (B, T, Hk, Dk); v, o (B, T, Hv, Dv); g, beta (B, T, Hv); s (B, Hv, Dk, Dv): contiguous
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // HV, bh % HV
    hk = h // REP
    ks = tl.arange(0, BK)
    vs = tl.program_id(1) * BV + tl.arange(0, BV)
    km, vm = ks < DK, vs < DV
    s_ptr = S + bh * DK * DV + ks[:, None] * DV + vs[None, :]
    s = tl.load(s_ptr, mask=km[:, None] & vm[None, :], other=0.0)
    hk_n = HV // REP
    for t in range(T):
        qk_off = ((b * T + t) * hk_n + hk) * DK + ks
        q = tl.load(Q + qk_off, mask=km, other=0.0).to(tl.float32)
        k = tl.load(K + qk_off, mask=km, other=0.0).to(tl.float32)
        v_off = ((b * T + t) * HV + h) * DV + vs
        v = tl.load(V + v_off, mask=vm, other=0.0).to(tl.float32)
        g = tl.load(G + (b * T + t) * HV + h)
        beta = tl.load(BETA + (b * T + t) * HV + h)
        s = s * tl.exp(g)
        u = beta * (v - tl.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * u[None, :]
        o = tl.sum(s * q[:, None], axis=0) * scale
        tl.store(OUT + v_off, o, mask=vm)
    tl.store(s_ptr, s, mask=km[:, None] & vm[None, :])


@triton.jit
def _chunk_kernel(
    Q, K, V, G, BETA, S, OUT,
    T, HV, DK, DV, REP, scale,
    BT: tl.constexpr, LOG2_BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // HV, bh % HV
    hk, hk_n = h // REP, HV // REP
    ks = tl.arange(0, BK)
    vs = tl.program_id(1) * BV + tl.arange(0, BV)
    km, vm = ks < DK, vs < DV
    s_ptr = S + bh * DK * DV + ks[:, None] * DV + vs[None, :]
    s = tl.load(s_ptr, mask=km[:, None] & vm[None, :], other=0.0)  # (BK, BV) fp32
    rows = tl.arange(0, BT)
    lower = rows[:, None] > rows[None, :]  # strictly: j < i
    causal = rows[:, None] >= rows[None, :]
    for c0 in range(0, T, BT):
        ts = c0 + rows
        tm = ts < T  # past the end: zeros, and g = beta = 0 change nothing
        qk_off = ((b * T + ts[:, None]) * hk_n + hk) * DK + ks[None, :]
        qk_m = tm[:, None] & km[None, :]
        q = tl.load(Q + qk_off, mask=qk_m, other=0.0).to(tl.float32)  # (BT, BK)
        k = tl.load(K + qk_off, mask=qk_m, other=0.0).to(tl.float32)
        v_off = ((b * T + ts[:, None]) * HV + h) * DV + vs[None, :]
        v_m = tm[:, None] & vm[None, :]
        v = tl.load(V + v_off, mask=v_m, other=0.0).to(tl.float32)  # (BT, BV)
        g = tl.load(G + (b * T + ts) * HV + h, mask=tm, other=0.0)
        beta = tl.load(BETA + (b * T + ts) * HV + h, mask=tm, other=0.0)
        gc = tl.cumsum(g, axis=0)  # (BT,) log decay from the chunk's start
        diff = gc[:, None] - gc[None, :]
        decay = tl.exp(tl.where(causal, diff, float("-inf")))  # (BT, BT), 0 above
        kk = mma(k, tl.trans(k))  # (BT, BT)
        a = tl.where(lower, beta[:, None] * kk * decay, 0.0)
        # (I + A)^-1 = sum_{j < BT} (-A)^j (A is nilpotent: A^BT = 0), summed by doubling:
        # inv = (I - A)(I + A^2)(I + A^4)...: log2(BT) matmul pairs, not BT row updates
        inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0) - a
        p = -a
        for _ in tl.static_range(LOG2_BT - 1):
            p = mma(p, p)
            inv = inv + mma(inv, p)
        # the new values: (I + A)^-1 beta (V - exp(G) K S0)
        u = mma(inv, beta[:, None] * (v - tl.exp(gc)[:, None] * mma(k, s)))  # (BT, BV)
        attn = mma(q, tl.trans(k)) * decay  # (BT, BT), lower with the diagonal
        o = tl.exp(gc)[:, None] * mma(q, s) + mma(attn, u)
        tl.store(OUT + v_off, o * scale, mask=v_m)
        g_end = tl.sum(g, axis=0)  # the chunk's whole log decay
        k_end = k * tl.exp(g_end - gc)[:, None]
        s = s * tl.exp(g_end) + mma(tl.trans(k_end), u)
    tl.store(s_ptr, s, mask=km[:, None] & vm[None, :])


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The Triton launcher of `kernels.reference.gated_delta_rule` (same arguments; `state`
    overwritten in place). T == 1: the recurrent kernel; T > 1: the chunked one."""
    op = "gated_delta_rule"
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    require(q.shape == k.shape, op, f"q {tuple(q.shape)} != k {tuple(k.shape)}")
    require(v.shape[:2] == (b, t) and hv % hk == 0, op, f"v {tuple(v.shape)} vs k {(b, t, hk)}")
    require(g.shape == beta.shape == (b, t, hv), op, f"g / beta must be {(b, t, hv)}")
    require(state.shape == (b, hv, dk, dv), op, f"state {tuple(state.shape)} != {(b, hv, dk, dv)}")
    require(state.dtype == torch.float32 and state.is_contiguous(), op, "state: contiguous fp32")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    if t == 0:
        return o.to(v.dtype)
    bk = max(16, triton.next_power_of_2(dk))
    bv = min(max(16, triton.next_power_of_2(dv)), 64)
    grid = (b * hv, triton.cdiv(dv, bv))
    args = (q, k, v, g, beta, state, o, t, hv, dk, dv, hv // hk, scale)
    if t == 1:
        _recurrent_kernel[grid](*args, BK=bk, BV=bv)
    else:
        _chunk_kernel[grid](*args, BT=CHUNK, LOG2_BT=CHUNK.bit_length() - 1, BK=bk, BV=bv)
    return o.to(v.dtype)
