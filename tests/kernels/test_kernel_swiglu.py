"""SwiGLU on a fused [gate | up] tensor: Triton vs kernels.reference."""

from __future__ import annotations

import pytest
import torch
from kernel_harness import DTYPES, assert_close, gpu, randn, triton_op

from kernels import KernelError, reference

TOL = {
    # exp() of the two implementations differs by a few fp32 ulp
    torch.float32: (1e-6, 1e-5),
    # roundings mirror the reference (silu cast to bf16, then the product); an exp() ulp can
    # flip the first cast, and the product by one more ulp: <= 2 bf16 ulp = 2^-6 relative
    torch.bfloat16: (1e-6, 2**-6),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 64), (3, 37, 2 * 77), (5, 2 * 123), (3, 1, 2 * 700)])
def test_swiglu(shape, dtype):
    gate_up = randn(*shape, dtype=dtype, scale=3.0)  # wide range: silu's tails too
    assert_close(triton_op("swiglu")(gate_up), reference.swiglu(gate_up), TOL[dtype])


def test_non_contiguous_input():
    gate_up = randn(37, 2 * 77 + 6)[:, : 2 * 77]  # rows with a stride > 2I
    assert_close(triton_op("swiglu")(gate_up), reference.swiglu(gate_up), TOL[torch.float32])


def test_odd_width_raises():
    with pytest.raises(KernelError, match="even"):
        triton_op("swiglu")(randn(3, 7))


@gpu
@pytest.mark.parametrize("inter", [8192, 14336])
def test_swiglu_llama_sizes_gpu(inter):
    gate_up = randn(256, 2 * inter, dtype=torch.bfloat16, scale=3.0)
    assert_close(triton_op("swiglu")(gate_up), reference.swiglu(gate_up), TOL[torch.bfloat16])
