"""Prefill attention (T > 1, causal, GQA over the cache) and MLA prefill vs kernels.reference."""

from __future__ import annotations

import pytest
import torch
from kernel_harness import DEVICE, DTYPES, assert_close, gpu, randn, triton_op

from kernels import KernelError, reference

TOL = {
    # online softmax vs SDPA's: fp32 sums in another order, a few ulp of O(1) outputs
    torch.float32: (2e-6, 1e-5),
    # P cast to bf16 before P @ V (2^-9 relative per weight; the reference's math differs),
    # then one cast of the output: <= 2 bf16 ulp of |o| <= ~2
    torch.bfloat16: (2**-6, 2**-6),
}

# (B, Hq, Hkv, D, T, start_pos)
CASES = [
    (3, 6, 2, 24, 37, 0),  # batch 3, length 37 prompt, odd head dim, group 3
    (1, 4, 1, 16, 37, 5),  # a second chunk after 5 cached tokens, MQA
    (2, 4, 4, 40, 2, 30),  # two new tokens deep in the cache, MHA
    (1, 2, 1, 64, 16, 0),  # exactly one query tile
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefill_gqa(case, dtype):
    b, hq, hkv, d, t, start = case
    s = start + t
    q = randn(b, hq, t, d, dtype=dtype)
    k = randn(b + 1, hkv, s + 4, d, dtype=dtype, seed=1)[:b, :, :s]  # cache slices
    v = randn(b + 1, hkv, s + 4, d, dtype=dtype, seed=2)[:b, :, :s]
    got = triton_op("attention")(q, k, v, start, d**-0.5)
    assert_close(got, reference.attention(q, k, v, start, d**-0.5), TOL[dtype])


def test_prefill_strided_q_as_core_passes_it():
    # GQAAttention hands q as a transposed view of the fused qkv output
    b, hq, hkv, d, t = 2, 4, 2, 16, 9
    q = randn(b, t, hq, d).transpose(1, 2)
    k, v = randn(b, hkv, t, d, seed=1), randn(b, hkv, t, d, seed=2)
    got = triton_op("attention")(q, k, v, 0, 0.25)
    assert_close(got, reference.attention(q, k, v, 0, 0.25), TOL[torch.float32])


# (B, H, R latent, Dr rope, T, start_pos)
MLA_CASES = [(3, 5, 24, 8, 37, 0), (1, 16, 32, 16, 7, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MLA_CASES, ids=str)
def test_prefill_mla(case, dtype):
    b, h, r, dr, t, start = case
    s = start + t
    q_lat, q_pe = randn(b, h, t, r, dtype=dtype), randn(b, h, t, dr, dtype=dtype, seed=3)
    latent, k_pe = randn(b, s, r, dtype=dtype, seed=1), randn(b, s, dr, dtype=dtype, seed=2)
    scale = (r + dr) ** -0.5
    got = triton_op("mla_attention")(q_lat, q_pe, latent, k_pe, start, scale)
    want = reference.mla_attention(q_lat, q_pe, latent, k_pe, start, scale)
    assert_close(got, want, TOL[dtype])


def test_cache_shorter_than_positions_raises():
    q, k = randn(1, 2, 4, 16), randn(1, 2, 5, 16)
    with pytest.raises(KernelError, match="cache holds"):
        triton_op("attention")(q, k, k, 3, 0.25)


@gpu
@pytest.mark.parametrize("b,t,start", [(1, 2048, 0), (4, 512, 100)])
def test_prefill_llama8b_shapes_gpu(b, t, start):
    s = start + t
    q = randn(b, 32, t, 128, dtype=torch.bfloat16)
    k, v = randn(b, 8, s, 128, dtype=torch.bfloat16), randn(b, 8, s, 128, dtype=torch.bfloat16)
    got = triton_op("attention")(q, k, v, start, 128**-0.5)
    want = reference.attention(q, k, v, start, 128**-0.5)
    assert_close(got, want, TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_per_row_start_pos(dtype):
    b, hq, hkv, d, t = 3, 4, 2, 16, 5
    start = torch.tensor([0, 11, 3], device=DEVICE)
    s = 11 + t
    q = randn(b, hq, t, d, dtype=dtype)
    k, v = randn(b, hkv, s, d, dtype=dtype, seed=1), randn(b, hkv, s, d, dtype=dtype, seed=2)
    got = triton_op("attention")(q, k, v, start, 0.25)
    assert_close(got, reference.attention(q, k, v, start, 0.25), TOL[dtype])
    q_lat, q_pe = randn(b, 5, t, 24, dtype=dtype), randn(b, 5, t, 8, dtype=dtype, seed=3)
    latent, k_pe = randn(b, s, 24, dtype=dtype, seed=1), randn(b, s, 8, dtype=dtype, seed=2)
    got = triton_op("mla_attention")(q_lat, q_pe, latent, k_pe, start, 0.2)
    want = reference.mla_attention(q_lat, q_pe, latent, k_pe, start, 0.2)
    assert_close(got, want, TOL[dtype])
