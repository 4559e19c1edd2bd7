"""Mamba2's state-space scan (SSD): Triton (one-step kernel for one token, chunks of 32 for
more) and kernels.reference vs a sequential loop written here, outputs and the final state, on
odd shapes: several heads per group of B / C, prompts over several chunks with a ragged last
one, head and state dims below and between tl.dot's tiles, a non-zero state carried in, and
padding (dt = 0) that leaves the state as it is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_harness import DTYPES, assert_close, randn, triton_op

from kernels import KernelError, reference

TOL = {
    # fp32 throughout; the chunked form sums a chunk's terms in another order than the loop
    torch.float32: (1e-5, 1e-5),
    # x, B, C arrive rounded to bf16 (the same values for the loop); fp32 inside and out,
    # so only the order of the fp32 sums differs: fp32's tolerance, scaled by |y| ~ 10
    torch.bfloat16: (1e-4, 1e-5),
}


def inputs(b, t, h, g, p, n, dtype=torch.float32, seed=0):
    x = randn(b, t, h, p, seed=seed).to(dtype)
    bm = randn(b, t, g, n, seed=seed + 1).to(dtype)
    cm = randn(b, t, g, n, seed=seed + 2).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    dt = F.softplus(torch.randn(b, t, h, generator=gen) - 1).clamp(0.001, 2.0).to(x.device)
    a = -torch.rand(h, generator=gen).add(0.1).to(x.device)  # -exp(A_log) < 0
    state = randn(b, h, p, n, seed=seed + 3)
    return x, dt, a, bm, cm, state


def loop(x, dt, a, bm, cm, state):
    """The recurrence token by token, one (row, head) at a time: the definition."""
    b, t, h, _ = x.shape
    rep = h // bm.shape[2]
    s = state.clone()
    y = torch.zeros(x.shape, dtype=torch.float64)
    for r in range(b):
        for hh in range(h):
            sh = s[r, hh].double()
            for i in range(t):
                d = dt[r, i, hh].double()
                bv, cv = bm[r, i, hh // rep].double(), cm[r, i, hh // rep].double()
                sh = torch.exp(d * a[hh].double()) * sh + d * torch.outer(x[r, i, hh].double(), bv)
                y[r, i, hh] = sh @ cv
            s[r, hh] = sh.float()
    return y.float(), s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [
        (2, 75, 4, 2, 16, 16),  # 75 = 2 chunks of 32 + 11; two heads per group
        (1, 33, 3, 1, 12, 8),  # one token past a chunk; dims below tl.dot's 16; H = 3, G = 1
        (2, 1, 4, 2, 16, 24),  # one token from a non-zero state: the step kernel; N between tiles
    ],
)
def test_ssd_scan(shape, dtype):
    x, dt, a, bm, cm, state = inputs(*shape, dtype=dtype)
    want, s_want = loop(x, dt, a, bm, cm, state)
    for op in (reference.ssd_scan, triton_op("ssd_scan")):
        s = state.clone()
        got = op(x, dt, a, bm, cm, s, 16)
        assert_close(got, want, TOL[dtype])
        assert_close(s, s_want, TOL[torch.float32])
    assert (s_want - state).abs().max() > 0.1  # the state did move


def test_padding_leaves_the_state():
    """Tokens with dt = 0 (padding) change neither the state nor the real tokens' outputs,
    in the chunked kernel and in the step kernel."""
    x, dt, a, bm, cm, state = inputs(2, 40, 2, 1, 8, 16)
    dt2 = dt.clone()
    dt2[:, 30:] = 0
    op = triton_op("ssd_scan")
    s_pad, s_short = state.clone(), state.clone()
    padded = op(x, dt2, a, bm, cm, s_pad, 16)
    short = op(x[:, :30], dt[:, :30], a, bm[:, :30], cm[:, :30], s_short, 16)
    assert_close(padded[:, :30], short, TOL[torch.float32])
    assert_close(s_pad, s_short, TOL[torch.float32])
    s_step = state.clone()
    op(x[:, :1], dt2[:, 39:40], a, bm[:, :1], cm[:, :1], s_step, 16)
    assert torch.equal(s_step, state)


def test_bad_state_raises():
    x, dt, a, bm, cm, state = inputs(1, 4, 2, 1, 16, 16)
    with pytest.raises(KernelError, match="state"):
        triton_op("ssd_scan")(x, dt, a, bm, cm, state.half(), 16)
    with pytest.raises(KernelError, match="state"):
        triton_op("ssd_scan")(x, dt, a, bm, cm, state[:, :1], 16)
