"""The fused CPU step's MoE routing (kernels/cpu/moe.c, `kernels.cpu.moe.moe_route`) against
core.layers.moe.route, the modules' routing, over every scoring and top-k method."""

from __future__ import annotations

import pytest
import torch

from core.config import MoESpec
from core.layers.moe import route
from kernels.cpu.build import library
from kernels.cpu.moe import Experts, moe_route

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the step is unfused")

E, K, ROWS = 16, 4, 64
SPECS = {
    "softmax-greedy": dict(),  # Mixtral, Qwen3-MoE (not renormalised)
    "softmax-greedy-renorm": dict(norm_topk_prob=True),  # gpt-oss, Qwen3-MoE's checkpoints
    "sigmoid-greedy-scaled": dict(
        scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5
    ),
    # DeepSeek V2: the best 2 of 4 groups by their max score, weights scaled
    "softmax-group-limited": dict(
        topk_method="group_limited_greedy", num_groups=4, topk_groups=2, routed_scaling_factor=16.0
    ),
    # DeepSeek V3: sigmoid, groups by their top-2 sum of biased scores, unbiased weights
    "sigmoid-noaux_tc": dict(
        scoring="sigmoid",
        topk_method="noaux_tc",
        num_groups=4,
        topk_groups=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
    "softmax-noaux_tc-one-group": dict(topk_method="noaux_tc", num_groups=1, topk_groups=1),
}


def by_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's choice in the order of its ids (topk with sorted=False orders freely)."""
    ids, order = ids.sort(dim=-1)
    return ids, weights.gather(1, order)


@pytest.mark.parametrize("case", list(SPECS))
def test_the_c_routing_is_the_modules(case):
    spec = MoESpec(num_experts=E, top_k=K, intermediate_size=8, num_shared_experts=0,
                   layers=(0,), **SPECS[case])  # fmt: skip
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(ROWS, E, generator=g) * 2
    # a correction as large as the scores' spread: it moves choices (checked below)
    bias = torch.randn(E, generator=g) * 0.5 if spec.topk_method == "noaux_tc" else None
    experts = Experts(
        router=torch.zeros(E, 8), top_k=K, renorm=spec.norm_topk_prob, intermediate=8,
        gate_up=None, down=None, scoring=spec.scoring, method=spec.topk_method,
        groups=spec.num_groups, topk_groups=spec.topk_groups,
        scale=spec.routed_scaling_factor, correction=bias,
    )  # fmt: skip
    got = by_id(*moe_route(experts, logits))
    want = by_id(*route(logits, spec, bias))
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)  # an ulp or two
    if bias is not None:  # the bias chose (and only chose): without it the choice differs
        plain = by_id(*route(logits, spec, torch.zeros(E)))[0]
        assert not torch.equal(plain, want[0])
    if spec.topk_method != "greedy" and spec.num_groups > 1:  # and the groups limited it
        free = by_id(*route(logits, MoESpec(**{**spec.__dict__, "topk_groups": 4}), bias))[0]
        assert not torch.equal(free, want[0])
