"""A MoE layer's routed experts kept in block-scaled fp8 (kernels/qweight.py's `QuantExperts`:
DeepSeek-V3/R1's checkpoints) through the grouped GEMMs (kernels/moe.py, FP8 constexpr),
against the torch reference on the dequantized weights; the dequantization itself against
DeepSeek's weight_dequant written out here, over 128 x 128 blocks with partial edge blocks.
"""

from __future__ import annotations

import pytest
import torch
from kernel_harness import (
    CUDA,
    DEVICE,
    DTYPES,
    assert_close,
    assert_experts_match_dequantized,
    triton_op,
)

from kernels import KernelError, reference
from kernels.qweight import FP8, QuantExperts, QuantWeight, fp8_format
from plugins.formats.safetensors_fp8 import BlockFP8

pytestmark = pytest.mark.skipif(
    CUDA and torch.cuda.get_device_capability() < (8, 9),
    reason="Triton's float8e4nv needs compute capability 8.9+",
)
# the same fp32 products on both sides (weights rounded to x's dtype the same way); only the
# order of the sums differs, then one rounding to x's dtype (see test_kernel_moe.py)
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-6, 2**-6)}


def fp8_experts(e: int, n: int, k: int, block=(128, 128), seed=0):
    """E random fp8 (n, k) weights with block scales, as a `QuantExperts` (built by the
    checkpoint reader's `BlockFP8.keep`), and the raw (fp8 bytes, scale_inv) per expert."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g) * 300  # spans e4m3's range (+-448 after the cast)
    fp8 = w.clamp(-448, 448).to(torch.float8_e4m3fn)
    fp8[:, 0, :3] = torch.tensor([448.0, -448.0, 2.0**-9])  # edge values: max, min, subnormal
    grid = (-(-n // block[0]), -(-k // block[1]))
    scale_inv = torch.rand(e, *grid, generator=g) * 2e-3 / k**0.5 + 1e-5
    keep = BlockFP8(block).keep
    q = QuantExperts([keep(fp8[i], scale_inv[i]) for i in range(e)]).to(DEVICE)
    return q, fp8, scale_inv


def weight_dequant(fp8: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """DeepSeek's weight_dequant: w[i, j] = float32(fp8[i, j]) * scale_inv[i // 128, j // 128]."""
    rows = torch.arange(fp8.shape[-2]) // block[0]
    cols = torch.arange(fp8.shape[-1]) // block[1]
    return fp8.float() * scale_inv[..., rows[:, None], cols[None, :]]


@pytest.mark.parametrize("block", [(128, 128), (32, 48)])
def test_dequantize_is_weight_dequant(block):
    q, fp8, scale_inv = fp8_experts(3, 136, 200, block)  # partial edge blocks both ways
    assert q.shape == (3, 136, 200) and q.fmt.name == FP8 and q.codes.dtype == torch.uint8
    assert q.scales.shape == (3, 136, -(-200 // block[1]))
    assert torch.equal(q.dequantize().cpu(), weight_dequant(fp8, scale_inv, block))
    assert torch.equal(q.dequantize(1).cpu(), weight_dequant(fp8[1], scale_inv[1], block))


def moe_case(n, h, i, e, k, dtype, block=(128, 128), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype).to(DEVICE)
    gate_up = fp8_experts(e, 2 * i, h, block, seed + 1)[0]
    down = fp8_experts(e, h, i, block, seed + 2)[0]
    for w in (gate_up, down):
        w.dtype = dtype
    weights, ids = torch.randn(n, e, generator=g).softmax(-1).topk(k)
    return x, ids.to(DEVICE), weights.to(dtype).to(DEVICE), gate_up, down


# (N tokens, H hidden, I intermediate, E experts, K top-k): H = 136 and I = 40 are not
# multiples of 128 (a partial edge group; a single group narrower than a block); 256 is
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case,block",
    [((19, 136, 40, 4, 2), (128, 128)), ((1, 256, 24, 3, 2), (128, 128)),
     ((9, 72, 40, 4, 3), (32, 48))],
    ids=str,
)  # fmt: skip
def test_fp8_experts_match_the_reference_on_dequantized_weights(case, block, dtype):
    x, ids, w, gate_up, down = moe_case(*case, dtype, block)
    assert_experts_match_dequantized(x, ids, w, gate_up, down, TOL[dtype])


def test_fp8_experts_with_float_down(dtype=torch.float32):
    """One weight fp8 and the other float (FP8 is a per-GEMM flag)."""
    x, ids, w, gate_up, down = moe_case(7, 136, 40, 4, 2, dtype)
    down = down.dequantize()
    got = triton_op("moe_experts")(x, ids, w, gate_up, down)
    assert_close(got, reference.moe_experts(x, ids, w, gate_up.dequantize(), down), TOL[dtype])


def test_bad_fp8_scales_raise():
    x, ids, w, gate_up, down = moe_case(3, 136, 40, 4, 2, torch.float32)
    gate_up.scales = gate_up.scales[:, :, :1].contiguous()
    with pytest.raises(KernelError, match=r"gate_up: fp8 scales"):
        triton_op("moe_experts")(x, ids, w, gate_up, down)


def test_quant_experts_refuse_mixed_parts():
    a = QuantWeight(fp8_format(128), (4, 8), torch.zeros(4, 8, dtype=torch.uint8),
                    torch.ones(4, 1))  # fmt: skip
    b = QuantWeight(fp8_format(128), (4, 4), torch.zeros(4, 4, dtype=torch.uint8),
                    torch.ones(4, 1))  # fmt: skip
    with pytest.raises(ValueError, match="one format and shape"):
        QuantExperts([a, b])
