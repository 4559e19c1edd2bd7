"""Mamba2's state-space scan (SSD) in Triton: a single-step kernel for decode and a chunked one
for prefill, both carrying each (row, head)'s state in registers.

Per token (see kernels/reference.py `ssd_scan`), head h reading group g = h // (H / G):
h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T (P x N); y_t = h_t C_t. One program per (row,
head, block of BP head dims): the state's rows (head dims) are independent, so they split
across programs, each reading the whole N of B and C.

- `_step_kernel` (decode, T = 1): reads the state, applies one token, writes it back.
- `_chunk_kernel` walks chunks of BT tokens with SSD's quadratic form inside a chunk. With
  L the cumulative log decay from the chunk's start (L_i = sum_{s <= i} dt_s A) and h0 the
  state before it:
      Y = exp(L) (C h0^T) + ((C B^T) * exp(L_i - L_j) [j <= i] * dt_j) X
      h = exp(L_end) h0 + X^T ((exp(L_end - L) dt) * B)
  matmuls (`tl.dot`) instead of T state updates. Tokens with dt = 0 (padding, and the masked
  tail of the last chunk) neither decay nor add: the state passes them unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.casting import mma
from kernels.dispatch import interpreting, require

INTERPRETED = interpreting()
CHUNK = 32  # tokens per chunk (a power of two, >= 16 for tl.dot); the result does not depend on it


@triton.jit
def _step_kernel(
    X, DT, A, BM, CM, S, OUT,
    H, G, P, N, REP,
    BP: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # x, out (B, 1, H, P); dt (B, 1, H); bm, cm (B, 1, G, N); s (B, H, P, N): contiguous
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    g = h // REP
    ps = tl.program_id(1) * BP + tl.arange(0, BP)
    ns = tl.arange(0, BN)
    pm, nm = ps < P, ns < N
    s_ptr = S + bh * P * N + ps[:, None] * N + ns[None, :]
    s = tl.load(s_ptr, mask=pm[:, None] & nm[None, :], other=0.0)  # (BP, BN) fp32
    x = tl.load(X + bh * P + ps, mask=pm, other=0.0).to(tl.float32)
    bn = tl.load(BM + (b * G + g) * N + ns, mask=nm, other=0.0).to(tl.float32)
    cn = tl.load(CM + (b * G + g) * N + ns, mask=nm, other=0.0).to(tl.float32)
    dt = tl.load(DT + bh)
    s = s * tl.exp(dt * tl.load(A + h)) + (dt * x)[:, None] * bn[None, :]
    tl.store(OUT + bh * P + ps, tl.sum(s * cn[None, :], axis=1), mask=pm)
    tl.store(s_ptr, s, mask=pm[:, None] & nm[None, :])


@triton.jit
def _chunk_kernel(
    X, DT, A, BM, CM, S, OUT,
    T, H, G, P, N, REP,
    BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # x, out (B, T, H, P); dt (B, T, H); bm, cm (B, T, G, N); s (B, H, P, N): contiguous
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    g = h // REP
    ps = tl.program_id(1) * BP + tl.arange(0, BP)
    ns = tl.arange(0, BN)
    pm, nm = ps < P, ns < N
    s_ptr = S + bh * P * N + ps[:, None] * N + ns[None, :]
    s = tl.load(s_ptr, mask=pm[:, None] & nm[None, :], other=0.0)  # (BP, BN) fp32
    a = tl.load(A + h)
    rows = tl.arange(0, BT)
    causal = rows[:, None] >= rows[None, :]
    for c0 in range(0, T, BT):
        ts = c0 + rows
        tm = ts < T  # past the end: dt = 0 and zeros change nothing
        x_off = ((b * T + ts[:, None]) * H + h) * P + ps[None, :]
        x_m = tm[:, None] & pm[None, :]
        x = tl.load(X + x_off, mask=x_m, other=0.0).to(tl.float32)  # (BT, BP)
        bc_off = ((b * T + ts[:, None]) * G + g) * N + ns[None, :]
        bc_m = tm[:, None] & nm[None, :]
        bm = tl.load(BM + bc_off, mask=bc_m, other=0.0).to(tl.float32)  # (BT, BN)
        cm = tl.load(CM + bc_off, mask=bc_m, other=0.0).to(tl.float32)
        dt = tl.load(DT + (b * T + ts) * H + h, mask=tm, other=0.0)  # (BT,)
        lc = tl.cumsum(dt * a, axis=0)  # (BT,) log decay from the chunk's start
        decay = tl.exp(tl.where(causal, lc[:, None] - lc[None, :], float("-inf")))  # 0 above
        scores = mma(cm, tl.trans(bm)) * decay * dt[None, :]  # (BT, BT)
        y = tl.exp(lc)[:, None] * mma(cm, tl.trans(s)) + mma(scores, x)  # (BT, BP)
        tl.store(OUT + x_off, y, mask=x_m)
        l_end = tl.sum(dt * a, axis=0)  # the chunk's whole log decay
        w = tl.exp(l_end - lc) * dt  # (BT,) each token's weight in the end state
        s = s * tl.exp(l_end) + mma(tl.trans(x), bm * w[:, None])
    tl.store(s_ptr, s, mask=pm[:, None] & nm[None, :])


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    bm: torch.Tensor,
    cm: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """The Triton launcher of `kernels.reference.ssd_scan` (same arguments; `state` overwritten
    in place; returns y (B, T, H, P) fp32). T == 1: the step kernel; T > 1: the chunked one,
    in chunks of CHUNK tokens whatever `chunk` says (the reference's chunk length: the result
    does not depend on it, and the kernel's tile is sized for registers)."""
    op = "ssd_scan"
    b, t, h, p = x.shape
    g, n = bm.shape[2], bm.shape[3]
    require(dt.shape == (b, t, h), op, f"dt {tuple(dt.shape)} != {(b, t, h)}")
    require(a.shape == (h,), op, f"A {tuple(a.shape)} != {(h,)}")
    require(bm.shape == cm.shape == (b, t, g, n), op, f"B / C must be {(b, t, g, n)}")
    require(g > 0 and h % g == 0, op, f"{h} heads do not split into {g} groups")
    require(state.shape == (b, h, p, n), op, f"state {tuple(state.shape)} != {(b, h, p, n)}")
    require(state.dtype == torch.float32 and state.is_contiguous(), op, "state: contiguous fp32")
    x, bm, cm = x.contiguous(), bm.contiguous(), cm.contiguous()
    dt, a = dt.float().contiguous(), a.float().contiguous()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if t == 0:
        return y
    bn = max(16, triton.next_power_of_2(n))
    bp = min(max(16, triton.next_power_of_2(p)), 64)
    grid = (b * h, triton.cdiv(p, bp))
    args = (x, dt, a, bm, cm, state, y)
    if t == 1:
        _step_kernel[grid](*args, h, g, p, n, h // g, BP=bp, BN=bn)
    else:
        _chunk_kernel[grid](*args, t, h, g, p, n, h // g, BT=CHUNK, BP=bp, BN=bn)
    return y
