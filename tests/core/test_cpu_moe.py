"""The fused CPU step's MoE kinds that no family it takes whole brings yet (DeepSeek's need MLA,
Qwen3-Next's DeltaNet): sigmoid / group-limited / noaux_tc routing, scaled weights, shared
experts with biases or behind Qwen3-Next's sigmoid gate, Nemotron-H's non-gated relu2 experts
(fp32, and kept in Q4_K blocks). A Qwen3-MoE model's MLPs are replaced by
`core.layers.moe.MoE` modules of such specs; the fused step must equal them."""

from __future__ import annotations

import pytest
import torch
from fixtures.block_weights import random_blocks
from fixtures.fused_steps import decode, feed, rel_err

from core import load_model
from core.config import MoESpec
from core.cpu_step import FusedStep, why_not
from core.layers.moe import MoE
from core.quantize import install
from kernels import blocks
from kernels.blocks import BlockExperts
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
    # Nemotron-H: non-gated relu2 experts and shared expert; here softmax greedy, not scaled
    "nemotron-h-relu2": MoESpec(**MOE, num_shared_experts=0, shared_intermediate_size=48,
                                gated=False, act="relu2"),
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


def test_relu2_experts_kept_in_q4_k_blocks(checkpoint):
    """Nemotron-H's relu2 experts (up (I, H), down (H, I) each) in Q4_K blocks, as a GGUF file
    quantized by llama.cpp keeps them: Q4_K's 256-value super-blocks, so hidden and the experts'
    width 256. The modules read the same blocks (kernels.linear per expert)."""
    spec = MoESpec(num_experts=8, top_k=2, intermediate_size=256, layers=(0, 1),
                   num_shared_experts=0, shared_intermediate_size=32, gated=False, act="relu2",
                   scoring="sigmoid", topk_method="noaux_tc", num_groups=2, topk_groups=1,
                   routed_scaling_factor=2.5)  # fmt: skip
    m = load_model(checkpoint(dict(QWEN3_MOE, hidden_size=256))[0], max_batch_size=2,
                   max_seq_len=64)  # fmt: skip
    for i, layer in enumerate(m.net.model.layers):
        layer.mlp = random_moe(256, spec, seed=i)
        for j, name in enumerate(("up_proj", "down_proj")):
            e, n, k = getattr(layer.mlp.experts, name).weight.shape
            # values of std ~0.06 (~k^-1/2, as random_moe's floats): each expert shows
            raw = [random_blocks("q4_k", n, k, 10 * i + 2 * x + j, scale=0.02) for x in range(e)]
            w = BlockExperts([blocks.repack("q4_k", [r], (n, k)) for r in raw])
            install(layer.mlp.experts, f"{name}.weight", w)
    m.step.fused = FusedStep(m.net)
    assert why_not(m.net) is None
    tokens = feed()
    got = decode(m, True, tokens)
    assert isinstance(m.net.model.layers[0].mlp.experts.up_proj.weight, BlockExperts)
    # the same blocks both ways, x rounded to Q8_K for them alike; as test_cpu_step's kept
    # weights, a value an ulp apart can meet a rounding step of x's blocks in the next product
    for g, w in zip(got, decode(m, False, tokens), strict=True):
        assert rel_err(g, w) < 5e-4
