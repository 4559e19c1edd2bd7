"""Quantized linear (kernels/quant_matmul.py: the split-K GEMV and the tiled kernel) against
kernels.reference.quant_linear, for every format of kernels.qweight.FORMATS (MXFP4 included)."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_harness import CUDA, DEVICE, DTYPES, assert_close, gpu, randn, triton_op
from test_qweight import random_blocks

import kernels
from kernels import KernelError, dispatch, reference
from kernels.qweight import FORMATS, QFormat, QuantWeight, quantize
from plugins.formats.gguf_quant import KEPT, repack

# (atol, rtol); atol is relative to the largest |output| (outputs are divided by a power of two
# near it: the weights' random fp16 scales span many magnitudes). Both sides dequantize to the
# same fp32 weights bit for bit: s * q is exact in fp32 (an fp16 scale has 11 significant bits,
# a K-quant's d * sub-scale 17, a code at most 8, or 6 after a K-quant's 17), so even a GPU's
# fused s * q + min rounds once, as the reference does; both then round them to x's dtype.
TOL = {
    # only the order of the fp32 sum over K differs (the products are exact fp32: no TF32)
    torch.float32: (1e-5, 1e-5),
    # the same fp32 sum in another order, rounded once to bf16 (as CPU F.linear does, bias
    # included): the two sums, a few fp32 ulp apart, can round to neighbours: 1 bf16 ulp
    torch.bfloat16: (1e-5, 2**-7),
    torch.float16: (1e-5, 2**-10),  # the same, 1 fp16 ulp
}
N = 55  # 48 + 7: a partial tile of output features
K = {"q4_k": 512, "q5_k": 512, "q6_k": 512, "per_row": 200}  # others: 480: tails of 128, 64
PER_ROW = QFormat("per_row", 8, 0)  # int8 with one fp32 scale per row (gpt-fast's), K any
KINDS = [*FORMATS, "per_row"]
CASES = {  # (rows of x, split_k): GEMV in one split (writes y itself), GEMV split, tiled
    "gemv-1split": (1, 1),
    "gemv": (1, None),
    "gemv-3rows": (3, None),
    "tiled-17rows": (17, None),
}


def quant_weight(kind: str, n: int = N, k: int | None = None, seed: int = 0) -> QuantWeight:
    """Random GGML blocks with edge rows (a zero scale, negative scales, every code at its
    maximum and at its minimum) repacked, or int8 / int4 quantized from floats with a zero
    row and a row of one large value (codes at their extremes)."""
    k = k or K.get(kind, 480)
    if kind in KEPT:
        return repack(kind, random_blocks(kind, n, k, seed=seed, edge=True), (n, k)).to(DEVICE)
    f = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    f[0], f[1, 5] = 0, 50.0
    if kind == "per_row":
        scale = f.abs().amax(dim=1, keepdim=True) / 127
        codes = torch.round(f / torch.where(scale == 0, 1, scale)).to(torch.int8)
        return QuantWeight(PER_ROW, (n, k), codes, scale).to(DEVICE)
    return quantize(f, kind).to(DEVICE)


def check(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = 2.0 ** math.ceil(math.log2(want.float().abs().max().item() or 1.0))  # exact
    assert_close(got / scale, want / scale, TOL[want.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_quant_linear(kind, case, dtype):
    rows, split_k = CASES[case]
    w = quant_weight(kind)
    x = randn(rows, w.in_features, dtype=dtype, seed=1)
    bias = randn(N, dtype=dtype, seed=2)
    got = triton_op("quant_linear")(x, w, bias, split_k=split_k)
    check(got, reference.quant_linear(x, w, bias))


@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "per_row"])
def test_fp16_activations(kind, rows):
    w = quant_weight(kind)
    x = randn(rows, w.in_features, dtype=torch.float16, seed=1, scale=0.05)  # |y| < fp16 max
    got = triton_op("quant_linear")(x, w)
    check(got, reference.quant_linear(x, w))


@pytest.mark.parametrize("rows", [1, 8, 9])  # GEMV at most 8 rows, tiled from 9
def test_no_bias_leading_dims_and_strided_x(rows):
    w = quant_weight("q4_1", n=40, k=96)
    x = randn(2, rows, 200, seed=3)[..., 7:103]  # (2, rows, 96), rows 200 apart
    got = triton_op("quant_linear")(x, w, None, split_k=3)
    assert got.shape == (2, rows, 40)
    check(got, reference.quant_linear(x, w))


def test_bad_shapes_raise():
    w = quant_weight("q8_0", n=8, k=64)
    with pytest.raises(KernelError, match="vs weight"):
        triton_op("quant_linear")(randn(1, 63), w)
    with pytest.raises(KernelError, match="bias"):
        triton_op("quant_linear")(randn(1, 64), w, randn(7))


@pytest.mark.skipif(CUDA, reason="the CPU policies")
@pytest.mark.parametrize(
    "policy,module", [("triton", "kernels.quant_matmul"), ("auto", "reference"),
                      ("torch", "reference")]
)  # fmt: skip
def test_linear_dispatch_on_cpu(monkeypatch, policy, module):
    """ZOO_KERNELS=triton runs the kernel in the interpreter; auto and torch the dequantizing
    reference (on CPUs weights kept quantized are block weights: kernels/cpu/qdot.c)."""
    monkeypatch.setattr(dispatch, "_chosen", {})
    monkeypatch.setenv("ZOO_KERNELS", policy)
    calls = []
    real = reference.quant_linear
    monkeypatch.setattr(reference, "quant_linear", lambda *a: calls.append(1) or real(*a))
    w, x = quant_weight("q4_0", n=8, k=64), randn(2, 64)
    got = kernels.linear(x, w)
    ran = len(calls)
    check(got, real(x, w))
    if module == "kernels.quant_matmul":
        assert ran == 0 and dispatch.pick("quant_linear", x).__module__ == module
    else:
        assert ran == 1


@gpu
@pytest.mark.parametrize("rows", [1, 4, 300])
@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "q8_0", "int4", "mxfp4"])
def test_llama_8b_shapes_gpu(kind, rows):
    w = quant_weight(kind, n=4096 + 7, k=4096)
    x = randn(rows, 4096, dtype=torch.bfloat16, seed=1)
    check(triton_op("quant_linear")(x, w), reference.quant_linear(x, w))
