"""The MoE router against a written-out, token-by-token reference; the MoE layer against a loop."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from core.config import DenseMLPSpec, MoESpec
from core.layers.mlp import GatedMLP
from core.layers.moe import MoE, Router, route


def reference_route(logits: torch.Tensor, spec: MoESpec, bias: torch.Tensor | None):
    """One token at a time, in plain Python: {expert: weight} per token."""
    out = []
    e, g = spec.num_experts, spec.num_groups
    for row in logits.tolist():
        if spec.scoring == "softmax":
            z = sum(math.exp(v) for v in row)
            scores = [math.exp(v) / z for v in row]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        choice = [s + (bias[i].item() if bias is not None else 0.0) for i, s in enumerate(scores)]
        allowed = range(e)
        if spec.topk_method != "greedy":
            size = e // g
            groups = [choice[j * size : (j + 1) * size] for j in range(g)]
            if spec.topk_method == "noaux_tc":  # a group ranks by its two best biased scores
                rank = [sum(sorted(grp, reverse=True)[:2]) for grp in groups]
            else:  # group_limited_greedy: by its best score
                rank = [max(grp) for grp in groups]
            best = sorted(range(g), key=lambda j: -rank[j])[: spec.topk_groups]
            allowed = [i for i in range(e) if i // size in best]
        picked = sorted(allowed, key=lambda i: -choice[i])[: spec.top_k]
        weights = [scores[i] for i in picked]  # unbiased
        if spec.norm_topk_prob:
            total = sum(weights) + 1e-20
            weights = [w / total for w in weights]
        out.append(
            {i: w * spec.routed_scaling_factor for i, w in zip(picked, weights, strict=True)}
        )
    return out


def as_dicts(ids: torch.Tensor, weights: torch.Tensor):
    return [
        dict(zip(i, w, strict=True)) for i, w in zip(ids.tolist(), weights.tolist(), strict=True)
    ]


def spec(**kw) -> MoESpec:
    base = dict(num_experts=16, top_k=4, intermediate_size=8, num_shared_experts=0, layers=(0,))
    return MoESpec(**{**base, **kw})


SPECS = {
    "v2-lite softmax greedy": spec(top_k=3),
    "v2 group-limited greedy": spec(
        topk_method="group_limited_greedy", num_groups=4, topk_groups=2, routed_scaling_factor=16.0
    ),
    "v3 sigmoid noaux_tc": spec(
        scoring="sigmoid",
        topk_method="noaux_tc",
        num_groups=8,
        topk_groups=3,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
    "softmax renormalised": spec(norm_topk_prob=True),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_route_matches_reference(name):
    s = SPECS[name]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, s.num_experts, generator=g) * 2
    bias = torch.randn(s.num_experts, generator=g) * 0.3 if s.topk_method == "noaux_tc" else None
    ids, weights = route(logits, s, bias)
    assert ids.shape == weights.shape == (64, s.top_k) and weights.dtype == torch.float32
    got, want = as_dicts(ids, weights), reference_route(logits, s, bias)
    for g_row, w_row in zip(got, want, strict=True):
        assert g_row.keys() == w_row.keys()
        for k in w_row:
            assert g_row[k] == pytest.approx(w_row[k], rel=1e-5)


def test_noaux_tc_bias_steers_choice_but_not_weights():
    s = spec(scoring="sigmoid", topk_method="noaux_tc", num_groups=1, topk_groups=1, top_k=1)
    logits = torch.tensor([[2.0, 1.0] + [-5.0] * 14])
    bias = torch.zeros(16)
    bias[1] = 0.5  # sigmoid(1) + 0.5 > sigmoid(2): expert 1 wins, weighted by sigmoid(1)
    ids, weights = route(logits, s, bias)
    assert ids.tolist() == [[1]]
    assert weights.item() == pytest.approx(torch.sigmoid(torch.tensor(1.0)).item())


def test_groups_limit_the_choice():
    # expert 0 scores best, but its group (0-3) has the worst top-2 sum: it is not chosen
    s = spec(scoring="sigmoid", topk_method="noaux_tc", num_groups=4, topk_groups=1, top_k=2)
    row = [4.0, -6.0, -6.0, -6.0] + [3.0, 3.0, -6.0, -6.0] + [-6.0] * 8
    ids, _ = route(torch.tensor([row]), s, torch.zeros(16))
    assert sorted(ids[0].tolist()) == [4, 5]
    # group_limited_greedy ranks groups by their best expert instead: group 0 wins
    s = spec(topk_method="group_limited_greedy", num_groups=4, topk_groups=1, top_k=2)
    ids, _ = route(torch.tensor([row]), s)
    assert 0 in ids[0].tolist()


def test_moe_layer_matches_loop_over_experts():
    s = spec(num_experts=6, top_k=2, num_shared_experts=2, intermediate_size=5)
    hidden = 12
    torch.manual_seed(0)
    moe = MoE(hidden, s)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    x = torch.randn(2, 7, hidden)
    ids, weights = route(x.reshape(-1, hidden) @ moe.gate.weight.T, s)
    gate_up, down = moe.experts.gate_up_proj.weight, moe.experts.down_proj.weight
    want = torch.zeros(14, hidden)
    for n, tok in enumerate(x.reshape(-1, hidden)):
        for e, w in zip(ids[n].tolist(), weights[n], strict=True):
            gate, up = (gate_up[e] @ tok).chunk(2)
            want[n] += w * (down[e] @ (torch.nn.functional.silu(gate) * up))
    shared = GatedMLP(hidden, DenseMLPSpec(10))
    shared.load_state_dict(moe.shared_experts.state_dict())
    want = want.view(2, 7, hidden) + shared(x)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)


def test_stacked_expert_shards_cover_each_expert_once():
    moe = MoE(12, spec(num_experts=3, intermediate_size=5))
    gate_up, down = moe.experts.gate_up_proj.weight, moe.experts.down_proj.weight
    assert tuple(gate_up.shape) == (3, 10, 12) and tuple(down.shape) == (3, 12, 5)
    parts = {f"{e}.{p}" for e in range(3) for p in ("gate", "up")}
    assert set(gate_up.shards) == parts | {"T"}  # "T": the whole weight, stored transposed
    assert gate_up[gate_up.shards["2.up"]].shape == (5, 12)
    assert gate_up.shards["T"](gate_up).shape == (3, 12, 10)
    assert set(down.shards) == {"0", "1", "2", "T"} and down[down.shards["1"]].shape == (12, 5)
    assert not hasattr(moe, "shared_experts")  # num_shared_experts=0


def near_tie_inputs(s: MoESpec, hidden: int, tokens: int):
    """(x, W) in bf16 for a bf16 model's router. Rows 0-1 put experts 0 and 1 exactly at the
    top-k boundary, 2**-12 apart: the fp32 logits 4 and 4 + 2**-12 are both 4 in bf16, and so
    are their softmax / sigmoid scores, so a router that rounds anything to bf16 cannot tell
    which of the two to pick (row 0 wants expert 1, row 1 expert 0: no tie-break gets both).
    The other rows are random, with weights that an fp32 router gets to ~1e-6."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(s.num_experts, hidden, generator=g) * 0.3
    x = torch.randn(tokens, hidden, generator=g)
    x[:2], x[2:, :3], w[:, :3] = 0.0, 0.0, 0.0
    # column 0: the base logits. top_k - 1 experts clearly above experts 0 and 1, all in
    # group 0 (or the next groups) so that the groups keep them; the rest distinct, far below
    above = [2, 3, 4, 5, 6, 7][: s.top_k - 1]
    w[:, 0] = -1.0 - 0.25 * torch.arange(s.num_experts, dtype=torch.float32)
    w[above, 0] = torch.tensor([7.0, 6.5, 6.0, 5.5, 5.0, 4.5][: len(above)])
    w[[0, 1], 0] = 4.0
    w[1, 1] = w[0, 2] = 2.0**-12  # column 1 lifts expert 1, column 2 expert 0
    x[0, [0, 1]] = 1.0
    x[1, [0, 2]] = 1.0
    return x.bfloat16(), w.bfloat16()


@pytest.mark.parametrize("name", list(SPECS))
def test_bf16_router_picks_what_an_fp32_router_picks(name):
    """A bf16 model's router (bf16 hidden states, bf16 gate weight) computes its logits,
    scores, top-k and weights in fp32, as transformers and DeepSeek do
    (`F.linear(x.float(), W.float())`): the same experts and weights as the written-out router
    on the same bf16 values upcast."""
    s = SPECS[name]
    x, w = near_tie_inputs(s, hidden=64, tokens=64)
    router = Router(64, s).to(torch.bfloat16)
    bias = None
    if s.topk_method == "noaux_tc":  # kept fp32 by the loader; zero for experts 0 and 1
        bias = torch.randn(s.num_experts, generator=torch.Generator().manual_seed(2)) * 1e-3
        bias[:2] = 0.0
        router.e_score_correction_bias = torch.nn.Parameter(bias)
    with torch.no_grad():
        router.weight.copy_(w)
        ids, weights = router(x)
    assert weights.dtype == torch.float32
    logits = x.double() @ w.double().T
    # the premise: bf16 cannot separate experts 0 and 1 in the tie rows, fp32 can
    for row, winner in ((0, 1), (1, 0)):
        assert logits[row, winner] > logits[row, 1 - winner]
        assert logits[row, :2].bfloat16().unique().numel() == 1
    want = reference_route(logits, s, bias)
    assert {0, 1} & set(want[0]) == {1} and {0, 1} & set(want[1]) == {0}
    for g_row, w_row in zip(as_dicts(ids, weights), want, strict=True):
        assert g_row.keys() == w_row.keys()
        for k in w_row:
            assert g_row[k] == pytest.approx(w_row[k], rel=1e-5)


def test_gated_relu2_experts_are_refused():
    """relu2 experts are Nemotron-H's non-gated ones; gated ones would run the experts'
    SiLU kernel (and the fused CPU step reads relu2 as non-gated), so the spec is refused."""
    spec = MoESpec(
        num_experts=4, top_k=2, intermediate_size=16, num_shared_experts=0, layers=(0,), act="relu2"
    )
    with pytest.raises(ValueError, match="relu2 experts"):
        MoE(32, spec)
    MoE(32, dataclasses.replace(spec, gated=False))  # Nemotron-H's: built
