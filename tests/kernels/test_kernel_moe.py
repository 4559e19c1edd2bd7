"""Routed MoE experts (sort by expert + grouped GEMMs) vs kernels.reference."""

from __future__ import annotations

import pytest
import torch
from kernel_harness import DEVICE, DTYPES, assert_close, gpu, randn, triton_op

from kernels import KernelError, reference
from kernels.dispatch import kernel_module

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


@gpu
@pytest.mark.parametrize("n", [1, 16, 512])
def test_moe_deepseek_v2_lite_shapes_gpu(n):
    # DeepSeek-V2-Lite: 64 routed experts, top-6, hidden 2048, expert intermediate 1408
    args = moe_inputs(n, 2048, 1408, 64, 6, torch.bfloat16)
    assert_close(triton_op("moe_experts")(*args), reference.moe_experts(*args), TOL[torch.bfloat16])
