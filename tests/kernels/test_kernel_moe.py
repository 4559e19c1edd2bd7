"""Routed MoE experts (sort by expert + grouped GEMMs) vs kernels.reference, with float
weights and with MXFP4 ones (kernels/qweight.py's `QuantExperts`, gpt-oss's format: MX
constexpr), and gpt-oss's expert biases and clamped SwiGLU; fp8 experts: test_kernel_moe_fp8.py."""

from __future__ import annotations

import pytest
import torch
from kernel_harness import (
    DEVICE,
    DTYPES,
    assert_close,
    assert_experts_match_dequantized,
    gpu,
    randn,
    triton_op,
)

from kernels import KernelError, reference
from kernels.dispatch import kernel_module
from plugins.formats.safetensors_mxfp4 import keep

TOL = {
    # fp32 GEMMs with another summation order (exact fp32 products, no TF32)
    torch.float32: (1e-5, 1e-5),
    # the reference rounds each expert's output to bf16 and adds the K of them in bf16; the
    # kernel keeps them in fp32 and rounds once: the reference itself is ~K/2 bf16 ulp off
    torch.bfloat16: (2**-6, 2**-6),
}

# (N tokens, H hidden, I intermediate, E experts, K top-k)
CASES = [(37, 24, 40, 6, 2), (1, 24, 40, 6, 2), (3, 48, 20, 4, 1), (37, 33, 17, 8, 3)]


def moe_inputs(n, h, i, e, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = randn(n, h, dtype=dtype, seed=seed)
    gate_up = randn(e, 2 * i, h, dtype=dtype, seed=seed + 1, scale=h**-0.5)
    down = randn(e, h, i, dtype=dtype, seed=seed + 2, scale=i**-0.5)
    weights, ids = torch.randn(n, e, generator=g).softmax(-1).topk(k)
    return x, ids.to(DEVICE), weights.to(dtype).to(DEVICE), gate_up, down


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_moe(case, dtype):
    args = moe_inputs(*case, dtype)
    assert_close(triton_op("moe_experts")(*args), reference.moe_experts(*args), TOL[dtype])


def test_all_tokens_on_one_expert():
    x, ids, w, gate_up, down = moe_inputs(37, 24, 40, 6, 2, torch.float32)
    ids = torch.stack([torch.full_like(ids[:, 0], 5), torch.full_like(ids[:, 0], 2)], dim=1)
    got = triton_op("moe_experts")(x, ids, w, gate_up, down)
    assert_close(got, reference.moe_experts(x, ids, w, gate_up, down), TOL[torch.float32])


def test_sort_by_expert_groups_and_pads():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)
    sorted_pairs, block_expert = kernel_module("kernels.moe").sort_by_expert(ids, 4, 16)
    assert block_expert.tolist()[:4] == [0, 1, 2, 4]  # expert 3 got no tokens; 4 = unused
    pairs = sorted_pairs.view(-1, 16)
    assert pairs[0, :2].tolist() == [1, 4] and (pairs[0, 2:] == 6).all()  # 6 = padding
    assert pairs[1, :1].tolist() == [3]
    assert pairs[2, :3].tolist() == [0, 2, 5]


def test_shape_mismatch_raises():
    x, ids, w, gate_up, down = moe_inputs(3, 24, 40, 6, 2, torch.float32)
    with pytest.raises(KernelError, match="down"):
        triton_op("moe_experts")(x, ids, w, gate_up, down[:, :, :-1])
    with pytest.raises(KernelError, match="down_bias"):
        triton_op("moe_experts")(x, ids, w, gate_up, down, None, randn(6, 23))


def mxfp4_experts(e: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    """E random MXFP4 (n, k) weights as gpt-oss's checkpoints store them ((E, n, k / 32, 16)
    codes, e8m0 scales 2^-8 .. 2^-5 times e2m1 values up to 6: about the float tests' h^-0.5),
    kept by the reader's `keep`."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(119, 123, (e, n, k // 32), generator=g, dtype=torch.uint8)
    w = keep(codes, scales).to(DEVICE)
    w.dtype = dtype
    return w


def mxfp4_inputs(n, h, i, e, k, dtype, seed=0):
    x, ids, w = moe_inputs(n, h, i, e, k, dtype, seed)[:3]
    return x, ids, w, mxfp4_experts(e, 2 * i, h, dtype, seed + 1), mxfp4_experts(e, h, i, dtype)


# (N, H, I, E, K): one or several 32-column groups; K tiles of 64 with a partial one (96)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(19, 96, 32, 4, 2), (1, 64, 96, 3, 2)], ids=str)
def test_mxfp4_experts_match_the_reference_on_dequantized_weights(case, dtype):
    x, ids, w, gate_up, down = mxfp4_inputs(*case, dtype)
    assert_experts_match_dequantized(x, ids, w, gate_up, down, TOL[dtype])


def test_mxfp4_experts_with_float_down(dtype=torch.float32):
    """One weight MXFP4 and the other float (MX is a per-GEMM flag)."""
    x, ids, w, gate_up, down = mxfp4_inputs(7, 64, 32, 4, 2, dtype)
    down = down.dequantize()
    got = triton_op("moe_experts")(x, ids, w, gate_up, down)
    assert_close(got, reference.moe_experts(x, ids, w, gate_up.dequantize(), down), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["float", "mxfp4"])
def test_biases_and_clamped_swiglu(kind, dtype):
    """gpt-oss's experts: a bias after each GEMM and the clamped SwiGLU over interleaved
    (gate, up) rows, with a limit that bites (0.5: many gate / up values pass it)."""
    case = (19, 64, 32, 4, 2)
    x, ids, w, gate_up, down = (mxfp4_inputs if kind == "mxfp4" else moe_inputs)(*case, dtype)
    biases = randn(4, 64, dtype=dtype, seed=7), randn(4, 64, dtype=dtype, seed=8)
    args = (x, ids, w, gate_up, down, *biases, (1.702, 0.5))
    want = reference.moe_experts(*args)
    assert_close(triton_op("moe_experts")(*args), want, TOL[dtype])
    # not vacuous: without the biases, or with the plain SwiGLU, the output differs
    assert (reference.moe_experts(*args[:5], None, None, args[7]) - want).abs().max() > 0.1
    assert (reference.moe_experts(*args[:7]) - want).abs().max() > 0.1


def test_bad_mxfp4_scales_raise():
    x, ids, w, gate_up, down = mxfp4_inputs(3, 64, 32, 4, 2, torch.float32)
    down.scales = down.scales.float()
    with pytest.raises(KernelError, match=r"down: mxfp4 scales"):
        triton_op("moe_experts")(x, ids, w, gate_up, down)


@gpu
@pytest.mark.parametrize("n", [1, 16, 512])
def test_moe_deepseek_v2_lite_shapes_gpu(n):
    # DeepSeek-V2-Lite: 64 routed experts, top-6, hidden 2048, expert intermediate 1408
    args = moe_inputs(n, 2048, 1408, 64, 6, torch.bfloat16)
    assert_close(triton_op("moe_experts")(*args), reference.moe_experts(*args), TOL[torch.bfloat16])


@gpu
@pytest.mark.parametrize("n", [1, 16, 512])
def test_moe_mxfp4_gpt_oss_20b_shapes_gpu(n):
    # gpt-oss-20b: 32 routed experts, top-4, hidden 2880, expert intermediate 2880
    args = mxfp4_inputs(n, 2880, 2880, 32, 4, torch.bfloat16)
    assert_close(triton_op("moe_experts")(*args), reference.moe_experts(*args), TOL[torch.bfloat16])
