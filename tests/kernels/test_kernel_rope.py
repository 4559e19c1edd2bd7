"""RoPE in place on q and k: half-split and interleaved, partial rotary, per-row positions."""

from __future__ import annotations

import pytest
import torch
from kernel_harness import DEVICE, DTYPES, assert_close, gpu, randn, triton_op

from kernels import KernelError, reference

TOL = {
    # a GPU may fuse x1*c - x2*s into one FMA: 1 fp32 ulp of values below 4
    torch.float32: (1e-6, 1e-6),
    # the kernel rounds after every product and sum exactly where the reference's bf16 ops
    # do, so the results are bit-identical
    torch.bfloat16: (0.0, 0.0),
}

# (B, Hq, Hk, T, D, rotary dims R)
CASES = [
    (1, 4, 2, 1, 16, 16),  # decode: one token
    (3, 5, 3, 37, 24, 24),  # odd head counts and length
    (3, 6, 1, 37, 40, 16),  # partial rotary: dims 16.. pass through
    (2, 12, 12, 7, 24, 8),  # MLA-like: 8 of 24 dims roped
]


def tables(rows: int, t: int, rot: int, seed: int = 0):
    """cos/sin (rows, T, R/2): each row at its own positions when rows > 1."""
    g = torch.Generator().manual_seed(seed)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    start = torch.randint(0, 500, (rows, 1), generator=g)
    angles = (start + torch.arange(t))[..., None].float() * inv
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


def fused_qkv(b, hq, hk, t, d, dtype):
    """q, k as the strided views GQAAttention makes of one fused qkv projection."""
    qkv = randn(b, t, (hq + 2 * hk) * d, dtype=dtype, seed=3)
    q = qkv[..., : hq * d].view(b, t, hq, d).transpose(1, 2)
    k = qkv[..., hq * d : (hq + hk) * d].view(b, t, hk, d).transpose(1, 2)
    return q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("per_row", [False, True], ids=["shared-pos", "per-row-pos"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_rope(case, per_row, interleaved, dtype):
    b, hq, hk, t, d, rot = case
    cos, sin = tables(b if per_row else 1, t, rot)
    q, k = fused_qkv(b, hq, hk, t, d, dtype)
    want_q, want_k = reference.apply_rope(q.clone(), k.clone(), cos, sin, interleaved)
    got_q, got_k = triton_op("apply_rope")(q, k, cos, sin, interleaved)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    assert_close(got_q, want_q, TOL[dtype])
    assert_close(got_k, want_k, TOL[dtype])


def test_unit_stride_required_else_copied():
    cos, sin = tables(1, 5, 16)
    q = randn(2, 16, 5, 3).transpose(1, 3)  # (2, 3, 5, 16) with last-dim stride 15
    k = randn(2, 1, 5, 16, seed=1)
    want_q, want_k = reference.apply_rope(q, k.clone(), cos, sin, False)
    got_q, got_k = triton_op("apply_rope")(q, k, cos, sin, False)
    assert_close(got_q, want_q, TOL[torch.float32])
    assert_close(got_k, want_k, TOL[torch.float32])


def test_rotary_dims_past_head_dim_raise():
    cos, sin = tables(1, 3, 32)
    with pytest.raises(KernelError, match="rotary dims"):
        triton_op("apply_rope")(randn(1, 2, 3, 16), randn(1, 2, 3, 16), cos, sin, False)


@gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_llama8b_prefill_gpu(interleaved):
    cos, sin = tables(2, 1000, 128)
    q, k = fused_qkv(2, 32, 8, 1000, 128, torch.bfloat16)
    want_q, want_k = reference.apply_rope(q.clone(), k.clone(), cos, sin, interleaved)
    got_q, got_k = triton_op("apply_rope")(q, k, cos, sin, interleaved)
    assert_close(got_q, want_q, TOL[torch.bfloat16])
    assert_close(got_k, want_k, TOL[torch.bfloat16])
