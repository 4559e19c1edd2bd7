"""The gated delta rule (gated DeltaNet): Triton (recurrent step for one token, chunks of 32
for more) vs kernels.reference (a token-by-token step, chunks of 64), outputs and the final
state, on odd shapes: prompts over several chunks with a ragged last one, value heads sharing
key heads, head dims below and between tl.dot's tiles, an initial state carried in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_harness import DTYPES, assert_close, randn, triton_op

from kernels import KernelError, reference

TOL = {
    # both accumulate in fp32; the chunked forms solve a triangular system per chunk, whose
    # rounding grows with the chunk (a few hundred fp32 ulp of the output's scale)
    torch.float32: (2e-5, 2e-5),
    # q, k, v arrive rounded to bf16 (the same values for both); fp32 inside, one bf16
    # rounding of the output: 1 ulp = 2^-8, and a flip on either side of it
    torch.bfloat16: (2e-3, 2**-7),
}


def inputs(b, t, hk, hv, dk, dv, dtype=torch.float32, seed=0):
    q = F.normalize(randn(b, t, hk, dk, seed=seed), dim=-1).to(dtype)  # the layer L2-norms q, k
    k = F.normalize(randn(b, t, hk, dk, seed=seed + 1), dim=-1).to(dtype)
    v = randn(b, t, hv, dv, scale=2.0, seed=seed + 2).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    g = -torch.rand(b, t, hv, generator=gen).to(v.device)  # log decay <= 0
    beta = torch.rand(b, t, hv, generator=gen).to(v.device)
    state = randn(b, hv, dk, dv, seed=seed + 3)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [
        (2, 150, 2, 4, 16, 16),  # 150 = 4 chunks of 32 + 22; 2 of 64 + 22 in the reference
        (1, 37, 1, 3, 8, 12),  # dims below tl.dot's 16: padded and masked
        (3, 33, 2, 2, 20, 24),  # one token past a chunk; dims between tiles
        (2, 1, 2, 4, 16, 16),  # one token: the recurrent kernel
    ],
)
def test_gated_delta_rule(shape, dtype):
    q, k, v, g, beta, state = inputs(*shape, dtype=dtype)
    s_ref, s_tri = state.clone(), state.clone()
    want = reference.gated_delta_rule(q, k, v, g, beta, s_ref, shape[4] ** -0.5)
    got = triton_op("gated_delta_rule")(q, k, v, g, beta, s_tri, shape[4] ** -0.5)
    assert_close(got, want, TOL[dtype])
    assert_close(s_tri, s_ref, TOL[torch.float32])
    assert (s_ref - state).abs().max() > 0.1  # the state did move


def test_chunks_equal_steps_and_padding_leaves_the_state():
    """The reference's chunked form equals its own step applied token by token, and tokens
    with g = beta = 0 (padding) change neither the state nor the real tokens' outputs."""
    q, k, v, g, beta, state = inputs(2, 70, 2, 4, 16, 8)
    s_chunk, s_step = state.clone(), state.clone()
    whole = reference.gated_delta_rule(q, k, v, g, beta, s_chunk, 0.25)
    steps = [
        reference.gated_delta_rule(*(x[:, i : i + 1] for x in (q, k, v, g, beta)), s_step, 0.25)
        for i in range(70)
    ]
    assert_close(whole, torch.cat(steps, dim=1), TOL[torch.float32])
    assert_close(s_chunk, s_step, TOL[torch.float32])
    g2, beta2 = g.clone(), beta.clone()
    g2[:, 50:], beta2[:, 50:] = 0, 0
    for op in (reference.gated_delta_rule, triton_op("gated_delta_rule")):
        s_pad, s_short = state.clone(), state.clone()
        padded = op(q, k, v, g2, beta2, s_pad, 0.25)
        short = op(*(x[:, :50] for x in (q, k, v, g, beta)), s_short, 0.25)
        assert_close(padded[:, :50], short, TOL[torch.float32])
        assert_close(s_pad, s_short, TOL[torch.float32])


def test_bad_state_raises():
    q, k, v, g, beta, state = inputs(1, 4, 1, 2, 16, 16)
    with pytest.raises(KernelError, match="state"):
        triton_op("gated_delta_rule")(q, k, v, g, beta, state.half(), 0.25)
    with pytest.raises(KernelError, match="state"):
        triton_op("gated_delta_rule")(q, k, v, g, beta, state[:, :1], 0.25)
