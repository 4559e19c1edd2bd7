"""Block-scaled fp8 weights kept as they are (kernels/qweight.py's `fp8_format`, DeepSeek-V3/R1's
checkpoints) through the quantized linear kernels (kernels/quant_matmul.py), against the
dequantizing reference, itself checked against DeepSeek's weight_dequant written out here.

Shapes: in_features not a multiple of the 128-column block (partial edge groups, and one
narrower than a block), out_features not a multiple of the kernels' tiles; edge values: +-448
(e4m3's largest), subnormals, +-0, zero scales. Bytes 0x7F / 0xFF (e4m3's NaN) are never drawn:
a checkpoint holding them is refused at load (plugins/formats/safetensors_fp8.py, tests/plugins).
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_harness import CUDA, DEVICE, DTYPES, assert_close, randn, triton_op

from kernels import KernelError, reference
from kernels.qweight import FP8, QuantWeight, cat_rows, fp8_format

pytestmark = pytest.mark.skipif(
    CUDA and torch.cuda.get_device_capability() < (8, 9),
    reason="Triton's float8e4nv needs compute capability 8.9+",
)
NAN = (0x7F, 0xFF)
# the products are the same fp32 roundings on both sides; only the order of the sum over K
# differs (fp32), then one rounding to x's dtype (bf16: the two sums may round to neighbours)
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-5, 2**-7)}
CASES = {"gemv-1split": (1, 1), "gemv": (1, None), "gemv-3rows": (3, None), "tiled": (17, None)}


def fp8_bytes(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """(n, k) uint8 e4m3 codes, every byte but NaN, with rows of edge values."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32)
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0x3C  # NaN -> 1.5
    codes[0] = 0x7E  # +448
    codes[1] = 0xFE  # -448
    codes[2] = torch.arange(k) % 16 % 8 + 128 * (torch.arange(k) % 16 >= 8)  # +-subnormals, +-0
    codes[3, ::2] = 0x80  # -0
    return codes.to(torch.uint8)


def fp8_weight(n: int, k: int, group: int = 128, seed: int = 0) -> QuantWeight:
    """A kept fp8 weight with DeepSeek-like fp32 scales (|w| about 1), one block row zeroed."""
    g = torch.Generator().manual_seed(seed + 1)
    scales = torch.rand(n, math.ceil(k / group), generator=g) * 4 / 448
    scales[4:6, -1] = 0  # zero scales (the partial edge group)
    return QuantWeight(fp8_format(group), (n, k), fp8_bytes(n, k, seed), scales).to(DEVICE)


def weight_dequant(w: QuantWeight) -> torch.Tensor:
    """DeepSeek's weight_dequant, written independently: float32(fp8) * its block's scale."""
    k = w.in_features
    fp8 = w.codes.cpu().view(torch.float8_e4m3fn)
    s = torch.stack([w.scales.cpu()[:, j // w.fmt.group] for j in range(k)], dim=1)
    return fp8.to(torch.float32) * s


def test_fixture_has_the_edge_values():
    w = fp8_weight(8, 200)
    f = w.codes.cpu().view(torch.float8_e4m3fn).float()
    assert f[0].eq(448).all() and f[1].eq(-448).all()
    sub = f[2][f[2] != 0].abs()
    assert sub.numel() and (sub < 2**-6).all()  # e4m3's smallest normal is 2^-6
    assert torch.signbit(f[3, ::2]).all() and not f.isnan().any()


@pytest.mark.parametrize("shape,group", [((55, 200), 128), ((40, 96), 128), ((9, 136), 48)])
def test_reference_is_deepseeks_weight_dequant(shape, group):
    w = fp8_weight(*shape, group=group)
    want = weight_dequant(w)
    assert torch.equal(w.dequantize().cpu(), want)  # bit for bit
    rows = torch.tensor([[5, 0], [2, 5]], device=DEVICE)
    assert torch.equal(w.select_rows(rows).cpu(), want[rows.cpu()])
    assert torch.equal(w.dequantize(slice(3, 7)).cpu(), want[3:7])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shape,group", [((55, 200), 128), ((40, 96), 128), ((9, 136), 48)])
def test_quant_linear_fp8(shape, group, case, dtype):
    rows, split_k = CASES[case]
    w = fp8_weight(*shape, group=group)
    x = randn(rows, w.in_features, dtype=dtype, seed=1)
    bias = randn(w.out_features, dtype=dtype, seed=2)
    got = triton_op("quant_linear")(x, w, bias, split_k=split_k)
    want = torch.nn.functional.linear(x, weight_dequant(w).to(DEVICE).to(dtype), bias)
    assert not got.isnan().any()
    scale = 2.0 ** math.ceil(math.log2(want.float().abs().max().item()))
    assert_close(got / scale, want / scale, TOL[dtype])
    assert got[:, 4:6].ne(0).all()  # rows with a zero-scaled edge group still sum the rest


def test_fused_rows_and_bad_weights():
    """q|k|v of one block size stack into one weight (scales per row: any row split works);
    scales that do not cover the columns are a KernelError naming them."""
    a, b = fp8_weight(32, 200, seed=1), fp8_weight(23, 200, seed=2)
    w = cat_rows([a, b])
    assert w.fmt.name == FP8 and w.shape == (55, 200)
    x = randn(2, 200, seed=3)
    got = triton_op("quant_linear")(x, w)
    want = torch.cat([reference.quant_linear(x, a), reference.quant_linear(x, b)], dim=-1)
    assert_close(got, want, TOL[torch.float32])
    short = QuantWeight(w.fmt, w.shape, w.codes, w.scales[:, :1].contiguous())
    with pytest.raises(KernelError, match="fp8 scales"):
        triton_op("quant_linear")(x, short)
