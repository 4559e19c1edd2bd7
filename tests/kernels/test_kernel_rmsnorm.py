"""RMSNorm and residual-add + RMSNorm: Triton vs kernels.reference."""

from __future__ import annotations

import pytest
import torch
from kernel_harness import DEVICE, DTYPES, assert_close, gpu, randn, triton_op

from kernels import KernelError, reference

TOL = {
    # same formula in fp32; only the order of the fp32 sum of squares differs: a few ulp
    torch.float32: (1e-5, 1e-5),
    # every rounding mirrors the reference (normalise in fp32, cast, scale, cast); a different
    # sum order can flip the cast of the normalised value by 1 ulp, and the product after it by
    # 1 more: <= 2 bf16 ulp = 2^-6 relative
    torch.bfloat16: (1e-6, 2**-6),
}
# the residual sum is one rounding of the same two numbers: bit-exact
EXACT = (0.0, 0.0)

SHAPES = [(2, 64), (3, 37, 123), (1, 1, 48), (5, 123, 123), (3, 1, 2048)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape, dtype):
    x = randn(*shape, dtype=dtype, seed=1)
    w = (0.5 + torch.rand(shape[-1])).to(dtype).to(DEVICE)
    got = triton_op("rms_norm")(x, w, 1e-5)
    assert_close(got, reference.rms_norm(x, w, 1e-5), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_residual(shape, dtype):
    x = randn(*shape, dtype=dtype, seed=1)
    res = randn(*shape, dtype=dtype, seed=2, scale=3.0)
    w = (0.5 + torch.rand(shape[-1])).to(dtype).to(DEVICE)
    normed, h = triton_op("rms_norm_residual")(x, res, w, 1e-6)
    want_normed, want_h = reference.rms_norm_residual(x, res, w, 1e-6)
    assert_close(h, want_h, EXACT)
    assert_close(normed, want_normed, TOL[dtype])


def test_fp32_weight_promotes_bf16_input():
    # Llama checkpoints may keep norm weights in fp32: output dtype follows `weight * h`
    x = randn(3, 37, 123, dtype=torch.bfloat16)
    w = (0.5 + torch.rand(123)).to(DEVICE)
    got = triton_op("rms_norm")(x, w, 1e-5)
    assert_close(got, reference.rms_norm(x, w, 1e-5), TOL[torch.float32])


def test_strided_rows():
    x = randn(6, 130)[::2, :123]  # rows 260 apart, last dim contiguous: no copy needed
    w = torch.rand(123, device=DEVICE) + 0.5
    assert_close(triton_op("rms_norm")(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), TOL[x.dtype])


def test_bad_weight_shape_raises():
    with pytest.raises(KernelError, match="weight"):
        triton_op("rms_norm")(randn(2, 8), torch.ones(9, device=DEVICE), 1e-5)


@gpu
@pytest.mark.parametrize("hidden", [2048, 4096, 8192])
def test_rms_norm_llama_sizes_gpu(hidden):
    x = randn(512, hidden, dtype=torch.bfloat16)
    res = randn(512, hidden, dtype=torch.bfloat16, seed=2)
    w = (0.5 + torch.rand(hidden)).to(torch.bfloat16).to(DEVICE)
    normed, h = triton_op("rms_norm_residual")(x, res, w, 1e-5)
    want_normed, want_h = reference.rms_norm_residual(x, res, w, 1e-5)
    assert_close(h, want_h, EXACT)
    assert_close(normed, want_normed, TOL[torch.bfloat16])
