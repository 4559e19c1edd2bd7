"""Decode attention (T == 1) over the static cache, GQA and MLA: Triton vs kernels.reference."""

from __future__ import annotations

import pytest
import torch
from kernel_harness import DEVICE, DTYPES, assert_close, gpu, randn, triton_op

from kernels import KernelError, reference
from kernels.dispatch import kernel_module

TOL = {
    # online softmax over splits vs one softmax: fp32 sums in another order, a few ulp of O(1)
    torch.float32: (2e-6, 1e-5),
    # P is cast to bf16 before P @ V (2^-9 relative per weight, as in flash kernels; the
    # reference keeps fp32), then the output is cast once: <= 2 bf16 ulp of |o| <= ~2
    torch.bfloat16: (2**-6, 2**-6),
}

# (B, Hq, Hkv, D, S): S = cache length including the new token
CASES = [
    (1, 4, 1, 16, 1),  # first token: length 1, MQA
    (3, 6, 2, 24, 37),  # batch 3, odd length and head dim, group 3
    (2, 8, 8, 40, 20),  # MHA
    (1, 12, 2, 64, 100),  # group 6, several key tiles
]


def cache(b, hkv, s, d, dtype, b_max=None, s_max=None):
    """k, v as the core passes them: slices [:b, :, :s] of a larger static cache."""
    b_max, s_max = b_max or b + 1, s_max or s + 5
    k = randn(b_max, hkv, s_max, d, dtype=dtype, seed=1)[:b, :, :s]
    v = randn(b_max, hkv, s_max, d, dtype=dtype, seed=2)[:b, :, :s]
    return k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_gqa(case, dtype):
    b, hq, hkv, d, s = case
    q = randn(b, hq, 1, d, dtype=dtype)
    k, v = cache(b, hkv, s, d, dtype)
    got = triton_op("attention")(q, k, v, s - 1, d**-0.5)  # T == 1 routes to decode
    assert_close(got, reference.attention(q, k, v, s - 1, d**-0.5), TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_per_row_lengths_and_splits(dtype, num_splits):
    b, hq, hkv, d, s = 3, 6, 2, 24, 37
    lens = torch.tensor([37, 1, 20], device=DEVICE)
    q = randn(b, hq, 1, d, dtype=dtype)
    k, v = cache(b, hkv, s, d, dtype)
    dec = kernel_module("kernels.decode_attention")
    got = dec.decode_attention(q, k, v, 0.2, seq_lens=lens, num_splits=num_splits)
    want = torch.cat(
        [
            reference.attention(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], n - 1, 0.2)
            for i, n in enumerate(lens.tolist())
        ]
    )
    assert_close(got, want, TOL[dtype])


# (B, H, R latent, Dr rope, S)
MLA_CASES = [(1, 4, 16, 8, 1), (3, 5, 24, 8, 37), (2, 16, 32, 16, 50)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MLA_CASES, ids=str)
def test_decode_mla(case, dtype):
    b, h, r, dr, s = case
    q_lat, q_pe = randn(b, h, 1, r, dtype=dtype), randn(b, h, 1, dr, dtype=dtype, seed=3)
    latent = randn(b + 1, s + 3, r, dtype=dtype, seed=1)[:b, :s]
    k_pe = randn(b + 1, s + 3, dr, dtype=dtype, seed=2)[:b, :s]
    scale = (r + dr) ** -0.5
    got = triton_op("mla_attention")(q_lat, q_pe, latent, k_pe, s - 1, scale)
    want = reference.mla_attention(q_lat, q_pe, latent, k_pe, s - 1, scale)
    assert_close(got, want, TOL[dtype])


def test_heads_not_a_multiple_raise():
    q, (k, v) = randn(1, 5, 1, 16), cache(1, 2, 4, 16, torch.float32)
    with pytest.raises(KernelError, match="multiple"):
        triton_op("attention")(q, k, v, 3, 0.25)


@gpu
@pytest.mark.parametrize("b,s", [(1, 4000), (8, 1000), (32, 129)])
def test_decode_llama8b_shapes_gpu(b, s):
    q = randn(b, 32, 1, 128, dtype=torch.bfloat16)
    k, v = cache(b, 8, s, 128, torch.bfloat16)
    got = triton_op("attention")(q, k, v, s - 1, 128**-0.5)
    assert_close(got, reference.attention(q, k, v, s - 1, 128**-0.5), TOL[torch.bfloat16])


@gpu
def test_decode_mla_deepseek_shapes_gpu():
    b, h, r, dr, s = 4, 16, 512, 64, 1000
    q_lat, q_pe = randn(b, h, 1, r, dtype=torch.bfloat16), randn(b, h, 1, dr, dtype=torch.bfloat16)
    latent, k_pe = randn(b, s, r, dtype=torch.bfloat16), randn(b, s, dr, dtype=torch.bfloat16)
    got = triton_op("mla_attention")(q_lat, q_pe, latent, k_pe, s - 1, 0.07)
    want = reference.mla_attention(q_lat, q_pe, latent, k_pe, s - 1, 0.07)
    assert_close(got, want, TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_per_row_start_pos_through_op(dtype):
    # batched generation: each row's new token at its own position, (B,) tensor start_pos
    b, hq, hkv, d, s = 3, 4, 2, 16, 37
    start = torch.tensor([36, 0, 19], device=DEVICE)
    q = randn(b, hq, 1, d, dtype=dtype)
    k, v = cache(b, hkv, s, d, dtype)
    got = triton_op("attention")(q, k, v, start, 0.25)
    assert_close(got, reference.attention(q, k, v, start, 0.25), TOL[dtype])
    q_lat, q_pe = randn(b, 5, 1, 24, dtype=dtype), randn(b, 5, 1, 8, dtype=dtype, seed=3)
    latent, k_pe = randn(b, s, 24, dtype=dtype, seed=1), randn(b, s, 8, dtype=dtype, seed=2)
    got = triton_op("mla_attention")(q_lat, q_pe, latent, k_pe, start, 0.2)
    want = reference.mla_attention(q_lat, q_pe, latent, k_pe, start, 0.2)
    assert_close(got, want, TOL[dtype])
