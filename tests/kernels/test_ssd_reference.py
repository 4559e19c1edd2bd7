"""kernels.reference.ssd_scan (Mamba2's scan): its chunked form equals its recurrent step
applied token by token (outputs and final state, fp32), for chunk lengths that split the
prompt raggedly, several heads per B / C group, and a non-zero state carried in; and a token
with dt = 0 (padding) changes neither the state nor the real tokens' outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_harness import assert_close, randn

from kernels import reference

TOL = (1e-5, 1e-5)  # fp32 both ways; the chunked form sums a chunk's terms in another order


def inputs(b, t, h, g, p, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dt = F.softplus(torch.randn(b, t, h, generator=gen) - 1)
    a = -torch.rand(h, generator=gen).add(0.1)  # -exp(A_log) < 0
    x = randn(b, t, h, p, seed=seed)
    bm, cm = randn(b, t, g, n, seed=seed + 1), randn(b, t, g, n, seed=seed + 2)
    return x, dt, a, bm, cm, randn(b, h, p, n, seed=seed + 3)


def steps(x, dt, a, bm, cm, state):
    """The recurrent step (T == 1) token by token."""
    ys = [reference.ssd_scan(*(m[:, i : i + 1] for m in (x, dt)), a, bm[:, i : i + 1],
                             cm[:, i : i + 1], state, 64) for i in range(x.shape[1])]  # fmt: skip
    return torch.cat(ys, dim=1)


@pytest.mark.parametrize("chunk", [8, 16, 64])
def test_chunked_equals_recurrent(chunk):
    x, dt, a, bm, cm, state = inputs(2, 37, 4, 2, 6, 5)
    s_chunk, s_step = state.clone(), state.clone()
    got = reference.ssd_scan(x, dt, a, bm, cm, s_chunk, chunk)
    want = steps(x, dt, a, bm, cm, s_step)
    assert_close(got, want, TOL)
    assert_close(s_chunk, s_step, TOL)
    assert (s_step - state).abs().max() > 0.1  # the state did move


def test_padding_leaves_the_state():
    x, dt, a, bm, cm, state = inputs(1, 20, 2, 1, 4, 3)
    s_real, s_pad = state.clone(), state.clone()
    y_real = reference.ssd_scan(x[:, :13], dt[:, :13], a, bm[:, :13], cm[:, :13], s_real, 8)
    dt_pad = dt.clone()
    dt_pad[:, 13:] = 0  # tokens 13.. are padding
    y_pad = reference.ssd_scan(x, dt_pad, a, bm, cm, s_pad, 8)
    assert_close(y_pad[:, :13], y_real, TOL)
    assert_close(s_pad, s_real, TOL)
