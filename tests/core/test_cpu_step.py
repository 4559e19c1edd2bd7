"""The fused CPU decode step (core/cpu_step.py, kernels/cpu/decode.c) against the modules it
replaces, and against transformers: ragged rows at their own positions, rings that wrap,
NoPE layers, partial and interleaved rope, biases, GeGLU with Gemma's norms and post-norms,
soft-caps, DeepSeek's MLA (q_lora or not, YaRN) and its MoE routings (V2-Lite's softmax greedy,
V3's sigmoid noaux_tc, shared experts), kept int4 / int8 weights, Qwen3-Next / Qwen3.5's gated
DeltaNet layers (their conv windows and states carried over the steps), gated attention and
gated shared experts, gpt-oss's biased, clamped experts, LFM2's gated short convs.
Each check first asserts that the fused step really ran."""

from __future__ import annotations

import pytest
import torch
from conftest import LLAMA31, LLAMA32
from fixtures.fused_steps import PROMPTS, decode, deepseek_checkpoint, feed, rel_err
from safetensors.torch import load_file, save_file

from core import load_model
from core.cpu_step import FusedStep, why_not
from kernels.cpu.build import MAX_ROWS, library

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the step is unfused")

BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# three gated-DeltaNet layers (Qwen's Dk = Dv, smaller) to one gated attention layer
LINEAR = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    head_dim=16,
    rope_theta=10000.0,
    partial_rotary_factor=0.5,
)
QWEN3_NEXT = dict(
    BASE,
    model_type="qwen3_next",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    **LINEAR,
)
CASES = {
    "llama3.2": LLAMA32,  # llama3 rope scaling, head_dim != hidden / heads, tied
    "qwen2-bias": dict(BASE, model_type="qwen2", tie_word_embeddings=True),  # q|k|v biases
    # a window of 5: the ring wraps during the steps below
    "mistral-window": dict(BASE, model_type="mistral", sliding_window=5, head_dim=None),
    "smollm3-nope": dict(BASE, model_type="smollm3", no_rope_layer_interval=2),
    # rope on 12 of 16 dims (LongRoPE), a window that never slides
    "phi3-partial": dict(
        BASE,
        model_type="phi3",
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        partial_rotary_factor=0.75,
        sliding_window=128,
        rope_scaling=dict(type="longrope", short_factor=[1.0] * 6, long_factor=[2.0] * 6),
    ),
    # widths that are not whole vectors (40, 72, heads of 10): each fp32 dot's masked tail
    "llama-odd-widths": dict(BASE, model_type="llama", hidden_size=40, intermediate_size=72),
    # GeGLU, (1 + w) norms, embeddings scaled by sqrt(hidden)
    "gemma": dict(
        BASE, model_type="gemma", head_dim=16, hidden_act="gelu_pytorch_tanh", bos_token_id=2
    ),
    "qwen3-qk-norm": dict(BASE, model_type="qwen3", head_dim=16),  # q and k heads RMS-normed
    # every layer a MoE of 8 experts, 3 chosen, their weights renormalised; q/k norms
    "qwen3-moe": dict(
        BASE,
        model_type="qwen3_moe",
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    # top-2 of 4, not renormalised (Qwen3-MoE's default), one dense layer (mlp_only_layers)
    "qwen3-moe-dense-layer": dict(
        BASE,
        model_type="qwen3_moe",
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    ),
    "mixtral": dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    # sinks, window-5 and full layers alternating, q/k/v/o biases, a router and experts with
    # biases, the clamped SwiGLU over interleaved (gate, up) rows (a limit the values pass)
    "gpt-oss": dict(
        BASE,
        model_type="gpt_oss",
        intermediate_size=32,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"] * 2,
        swiglu_limit=1.5,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=32
        ),
    ),
    # gated DeltaNet (in_proj stored flat) and gated attention: q_h | gate_h per head, a sigmoid
    # output gate, (1 + w) norms and q/k norms, rope on part of each head; dense MLPs
    "qwen3.5": dict(BASE, model_type="qwen3_5_text", **LINEAR),
    # in_proj grouped per key head; every MLP dense (mlp_only_layers)
    "qwen3-next-dense": dict(QWEN3_NEXT, mlp_only_layers=[0, 1, 2, 3]),
    # MoE layers (one dense) with the shared expert behind its sigmoid gate
    "qwen3-next": dict(QWEN3_NEXT, mlp_only_layers=[1], shared_expert_intermediate_size=32),
    "qwen3.5-moe": dict(
        BASE,
        model_type="qwen3_5_moe_text",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=32,
        **LINEAR,
    ),
    # post-norms, windows of 5 that wrap on layers 0 and 2, scores capped at 2 (the logits' cap
    # of 3 after the call: net.scale_logits), scale 1/sqrt(24)
    "gemma2": dict(
        BASE,
        model_type="gemma2",
        head_dim=16,
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=5,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        bos_token_id=2,
    ),
    # post-norms, q/k norms, layers 0, 1, 3 windowed with a local rope base of 100, 2 global
    # (theta 10000 stretched 4x); transformers 5's keys (conftest: raw)
    "gemma3_text": dict(
        BASE,
        model_type="gemma3_text",
        head_dim=16,
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=5,
        sliding_window_pattern=3,
        query_pre_attn_scalar=24,
        bos_token_id=2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    ),
    # LFM2: gated short convs (4 taps, biased in_proj / conv / out_proj) beside attention with
    # q/k norms; conv windows carried over the steps
    "lfm2": dict(
        BASE,
        model_type="lfm2",
        layer_types=["conv", "full_attention", "conv", "conv"],
        conv_L_cache=4,
        conv_bias=True,
        block_auto_adjust_ff_dim=False,
        norm_eps=1e-5,
    ),
    # LFM2-MoE: a dense first layer, then sigmoid-routed experts (noaux_tc in one group)
    "lfm2-moe": dict(
        BASE,
        model_type="lfm2_moe",
        layer_types=["conv", "full_attention", "conv", "conv"],
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_eps=1e-5,
    ),
}
RAW = {"gemma3_text"}
# DeepSeek's MLA, every MLP dense: a latent of 24 (not whole vectors), rope on 8 dims
# (interleaved), YaRN (V2-Lite: mscale = mscale_all_dim, the softmax scale corrected; V3: cos
# and sin scaled too)
MLA = dict(
    BASE,
    num_hidden_layers=3,
    first_k_dense_replace=3,
    num_key_value_heads=4,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    rms_norm_eps=1e-6,
)
YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1)
DEEPSEEK = {
    "deepseek-v2-lite": dict(
        MLA,
        model_type="deepseek_v2",
        q_lora_rank=None,
        rope_scaling=dict(YARN, mscale=0.707, mscale_all_dim=0.707),
    ),
    "deepseek-v3": dict(
        MLA,
        model_type="deepseek_v3",
        q_lora_rank=32,
        rope_scaling=dict(YARN, mscale=1.0, mscale_all_dim=0.8),
    ),
}
# their MoE layers after a dense one: V2-Lite's softmax greedy top-3 of 8, not renormalised, two
# shared experts; V3's sigmoid noaux_tc over 4 groups (2 kept), renormalised, scaled by 2.5,
# one shared expert
MOE = dict(first_k_dense_replace=1, moe_intermediate_size=24)
DEEPSEEK["deepseek-v2-lite-moe"] = dict(
    DEEPSEEK["deepseek-v2-lite"], **MOE, n_routed_experts=8, n_shared_experts=2,
    num_experts_per_tok=3, topk_method="greedy", norm_topk_prob=False,
)  # fmt: skip
DEEPSEEK["deepseek-v3-moe"] = dict(
    DEEPSEEK["deepseek-v3"], **MOE, n_routed_experts=16, n_shared_experts=1,
    num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
    routed_scaling_factor=2.5,
)  # fmt: skip
CASES.update(DEEPSEEK)


def load(checkpoint, tmp_path, case: str, **kw):
    """CASES[case]'s checkpoint, loaded."""
    if case in DEEPSEEK:
        root = deepseek_checkpoint(tmp_path / case, CASES[case])
    else:
        root = checkpoint(CASES[case], raw=case in RAW)[0]
    return load_model(root, max_batch_size=kw.pop("max_batch_size", 2), max_seq_len=64, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_the_fused_step_equals_the_modules(checkpoint, tmp_path, case):
    m = load(checkpoint, tmp_path, case)
    assert why_not(m.net) is None
    tokens = feed()
    for got, want in zip(decode(m, True, tokens), decode(m, False, tokens), strict=True):
        assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("kv", ["float16", "float32"])
@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_the_fused_step_on_weights_kept_quantized(checkpoint, quantize, kv):
    # in_features all multiples of 32 (the formats' blocks); the cache in fp16 (the default for
    # quantized weights on CPUs) or fp32
    root, _ = checkpoint(dict(LLAMA31, intermediate_size=96))
    m = load_model(root, max_batch_size=2, max_seq_len=64, quantize=quantize, kv_dtype=kv)
    assert m.net.kv_cache.layer(0)[0].dtype == getattr(torch, kv)
    tokens = feed(7)
    # the same block products (kernels/cpu/qdot.c) and cache either way, but the modules' attention
    # (SDPA) and SwiGLU (torch's silu) round otherwise, and values an fp32 ulp apart can meet a
    # rounding step: x's 15-bit steps in the next products (2^-15 of its block's largest value)
    # and, in an fp16 cache, fp16's (2^-11 of the value). A tiny model (hidden 64) feels each
    # such step: measured up to 1.2e-4 with an fp32 cache, 1.4e-4 with fp16; a wrong scale or
    # row would be off by the logits' own size
    bound = 1e-3 if kv == "float16" else 5e-4
    for got, want in zip(decode(m, True, tokens), decode(m, False, tokens), strict=True):
        assert rel_err(got, want) < bound


@pytest.mark.parametrize("kv", ["float32", "float16"])
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_mla_over_a_long_latent_cache(checkpoint, tmp_path, quantize, kv):
    """Rows whose latents span two tiles of 32 slots (kernels/cpu/mla.c's softmax carried from
    tile to tile), the latent cache in fp32 or fp16, MLA's products fp32 or kept in int8 blocks."""
    m = load(checkpoint, tmp_path, "deepseek-v3", quantize=quantize, kv_dtype=kv)
    assert m.net.kv_cache.layer(0)[0].dtype == getattr(torch, kv)
    prompts = ([5 + i % 90 for i in range(45)], [11 + 3 * i % 80 for i in range(20)])
    tokens = feed(5)
    # exact but for rounding with fp32 weights and cache; else, as the quantized test above
    # says, values an fp32 ulp apart can meet a rounding step of x's blocks or of fp16
    bound = 1e-5 if quantize is None and kv == "float32" else 1e-3
    got, want = decode(m, True, tokens, prompts), decode(m, False, tokens, prompts)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < bound


def test_the_fused_step_against_transformers(checkpoint):
    """Teacher-forced: each row's prompt and fed tokens through transformers alone."""
    root, ref = checkpoint(CASES["mistral-window"])
    m = load_model(root, max_batch_size=2, max_seq_len=64)
    tokens = feed(11)
    got = decode(m, True, tokens)
    for r, prompt in enumerate(PROMPTS):
        seq = torch.tensor([prompt + [step[r] for step in tokens]])
        with torch.no_grad():
            want = ref(seq).logits[0, len(prompt) :]  # the logits after each fed token
        assert rel_err(torch.stack([g[r] for g in got]), want) < 1e-4


def test_generation_takes_the_fused_step_and_agrees_with_the_modules(checkpoint, monkeypatch):
    root, _ = checkpoint(CASES["qwen2-bias"])
    # (no prefix cache: the second run prefills on its own, not from the first's rows)
    m = load_model(root, max_batch_size=2, max_seq_len=64, prefix_cache=False)
    m.eos_token_ids = set()
    calls = []
    real = FusedStep.__call__
    monkeypatch.setattr(FusedStep, "__call__", lambda *a: calls.append(1) or real(*a))
    fused = [r.token_ids for r in m.generate(list(PROMPTS), max_new_tokens=8)]
    assert len(calls) == 7  # every token after the prefill's
    monkeypatch.setenv("ZOO_KERNELS", "torch")  # the references: the fused step stands aside
    assert [r.token_ids for r in m.generate(list(PROMPTS), max_new_tokens=8)] == fused


def test_what_the_fused_step_does_not_take(checkpoint, monkeypatch):
    root, _ = checkpoint(LLAMA32)
    m = load_model(root, max_batch_size=MAX_ROWS + 1, max_seq_len=64)
    tokens, pos = torch.ones(MAX_ROWS + 1, dtype=torch.long), torch.zeros(MAX_ROWS + 1).long()
    assert m.step.fused(tokens, pos, 1) is None  # more rows than the C products take
    assert m.step.fused(tokens[:1], pos[:1], 1) is not None
    monkeypatch.setenv("ZOO_KERNELS", "torch")
    assert m.step.fused(tokens[:1], pos[:1], 1) is None
    # what it does not take is named: weights not fp32, a module of another kind
    m2 = load_model(root, max_seq_len=64, dtype="bfloat16")
    assert "weights are torch.bfloat16 on cpu" in why_not(m2.net)

    class Norm(type(m.net.model.layers[1].input_layernorm)):
        pass

    m.net.model.layers[1].post_attention_layernorm.__class__ = Norm
    assert why_not(m.net) == "block 1 has a Norm where it takes a RMSNorm"
    # Granite's residual_multiplier is taken (tests/kernels/test_cpu_mamba.py), but not before
    # post-norms: the modules scale the output before them, the C step after them
    m.net.model.layers[0].residual_scale = 0.5
    m.net.model.layers[0].post_norms = True
    want = "block 0 scales its sub-blocks' outputs by residual_scale before post-norms"
    assert why_not(m.net) == want


@pytest.mark.parametrize("case", ["mistral-window", "deepseek-v2-lite", "qwen3.5"])
def test_a_step_of_named_cache_rows_computes_just_those(checkpoint, tmp_path, case):
    """The server steps the rows that decode, wherever they lie in the cache: rows (2, 0) of
    three give the logits and cache writes of those rows in a step of all three, and row 1
    is left as it was: a ring that wraps, MLA's latent and k_pe caches, DeltaNet's states."""
    m = load(checkpoint, tmp_path, case, max_batch_size=3)
    prompts = [*PROMPTS, [17, 4, 60, 2, 9, 33]]
    ids = torch.zeros(3, max(map(len, prompts)), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p)
    m.forward(ids, 0, lengths=[len(p) for p in prompts])
    before = [t.clone() for bufs in m.net.kv_cache.layers for t in bufs]
    tokens, pos = torch.tensor([12, 50, 31]), torch.tensor([len(p) for p in prompts])
    with torch.inference_mode():
        want = m.net(tokens[:, None], pos, end=int(pos.max()) + 1)[:, -1]
        after = [t.clone() for bufs in m.net.kv_cache.layers for t in bufs]
        for t, b in zip((t for bufs in m.net.kv_cache.layers for t in bufs), before, strict=True):
            t.copy_(b)
        pick = torch.tensor([2, 0])
        assert m.step.takes_rows(2)
        got = m.step(tokens[pick], pos[pick], int(pos.max()) + 1, rows=pick)
    assert rel_err(got, want[pick]) < 1e-5
    caches = [t for bufs in m.net.kv_cache.layers for t in bufs]
    for t, b, a in zip(caches, before, after, strict=True):
        assert torch.equal(t[1], b[1])  # untouched
        assert rel_err(t[pick], a[pick]) < 1e-5
    for bad in ([3], [0, 0]):  # past the cache; one row twice
        with pytest.raises(IndexError, match="cache rows"):
            m.step(tokens[: len(bad)], pos[: len(bad)], 10, rows=torch.tensor(bad))
    with pytest.raises(IndexError, match="past the cache's 64"):  # the C step would write there
        m.step(tokens[:1], torch.tensor([64]), 65, rows=torch.tensor([0]))


def test_qwen3_next_moe_without_its_shared_expert(checkpoint):
    """Qwen3-Next's routed experts beside its DeltaNet layers (one dense layer), a config of no
    shared expert (shared_expert_intermediate_size 0): transformers then still writes empty
    shared-expert tensors, which a checkpoint without one would not hold, so they are
    dropped."""
    root, _ = checkpoint(dict(QWEN3_NEXT, mlp_only_layers=[1], shared_expert_intermediate_size=0))
    path = root / "model.safetensors"
    state = {k: v for k, v in load_file(path).items() if ".shared_expert" not in k}
    save_file(state, path, metadata={"format": "pt"})
    m = load_model(root, max_batch_size=2, max_seq_len=64)
    assert why_not(m.net) is None
    tokens = feed(4)
    for got, want in zip(decode(m, True, tokens), decode(m, False, tokens), strict=True):
        assert rel_err(got, want) < 1e-5


def test_a_delta_row_at_position_0_starts_afresh(checkpoint):
    """A row decoding at position 0 (a reused row) starts from an empty conv window and a zero
    state, as the module starts it, whatever the cache held."""
    m = load_model(checkpoint(CASES["qwen3.5"])[0], max_batch_size=2, max_seq_len=64)
    decode(m, True, feed()[:2])  # the caches now hold the prompts' states
    tokens, pos = torch.tensor([7, 41]), torch.tensor([0, 3])
    with torch.inference_mode():
        saved = [t.clone() for bufs in m.net.kv_cache.layers for t in bufs]
        want = m.net(tokens[:, None], pos, end=4)[:, -1]
        for t, b in zip((t for bufs in m.net.kv_cache.layers for t in bufs), saved, strict=True):
            t.copy_(b)
        got = m.step.fused(tokens, pos, 4)
    assert rel_err(got, want) < 1e-5
