"""The fused CPU step's MoE kinds that no family it takes whole brings yet (DeepSeek's need MLA,
Qwen3-Next's DeltaNet): sigmoid / group-limited / noaux_tc routing, scaled weights, shared
experts with biases or behind Qwen3-Next's sigmoid gate. A Qwen3-MoE model's MLPs are
replaced by `core.layers.moe.MoE` modules of such specs; the fused step must equal them."""

from __future__ import annotations

import pytest
import torch
from fixtures.fused_steps import decode, feed, rel_err

from core import load_model
from core.config import MoESpec
from core.cpu_step import FusedStep, why_not
from core.layers.moe import MoE
from kernels.cpu.build import library

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the step is unfused")

QWEN3_MOE = dict(
    model_type="qwen3_moe", vocab_size=96, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
    mlp_only_layers=[], max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
MOE = dict(num_experts=16, top_k=4, intermediate_size=32, layers=(0, 1))
SPECS = {
    # DeepSeek V3: sigmoid, noaux_tc over 2 of 4 groups, scaled, two experts' width shared
    "deepseek-v3": MoESpec(**MOE, num_shared_experts=2, scoring="sigmoid", topk_method="noaux_tc",
                           num_groups=4, topk_groups=2, norm_topk_prob=True,
                           routed_scaling_factor=2.5),
    # DeepSeek V2's group-limited softmax, a shared expert with biases
    "deepseek-v2-shared-bias": MoESpec(**MOE, num_shared_experts=1, shared_bias=True,
                                       topk_method="group_limited_greedy", num_groups=4,
                                       topk_groups=2, routed_scaling_factor=4.0),
    # Qwen3-Next / Qwen3.5: one shared expert of its own width behind sigmoid(x . gate)
    "qwen3-next": MoESpec(**MOE, num_shared_experts=0, norm_topk_prob=True,
                          shared_intermediate_size=48, shared_gate=True),
}  # fmt: skip


def random_moe(hidden: int, spec: MoESpec, seed: int) -> MoE:
    """A MoE of random weights large enough that each part shows in the output."""
    g = torch.Generator().manual_seed(seed)
    moe = MoE(hidden, spec)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            scale = 0.2 if p.dim() == 1 or "bias" in name else 2 * p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return moe


@pytest.mark.parametrize("case", list(SPECS))
def test_the_fused_step_equals_moe_modules_of_every_kind(checkpoint, case):
    m = load_model(checkpoint(QWEN3_MOE)[0], max_batch_size=2, max_seq_len=64)
    for i, layer in enumerate(m.net.model.layers):
        layer.mlp = random_moe(QWEN3_MOE["hidden_size"], SPECS[case], seed=i)
    m.step.fused = FusedStep(m.net)  # the kinds of blocks changed
    assert why_not(m.net) is None
    tokens = feed()
    for got, want in zip(decode(m, True, tokens), decode(m, False, tokens), strict=True):
        assert rel_err(got, want) < 1e-5
