"""DeepSeek V2 / V2-Lite / V3 parity against transformers on tiny random checkpoints (fp32).

The checkpoints are rewritten the way the hub ships them: per-expert tensor names
(`mlp.experts.E.gate_proj.weight`), a multi-token-prediction layer after the last decoder
layer (V3), and config.json in the hub's key style (`rope_scaling` with `type`,
`scoring_func`, `topk_method`, no transformers-only keys).
"""

from __future__ import annotations

import functools
import json
import math
import re

import pytest
import torch
from conftest import hub_style, randomize, save_in_memory_names
from parity import (
    ParitySuite,
    check_greedy,
    check_prefill,
    ids,
    rel_err,
)
from safetensors.torch import load_file, save_file

from core import CheckpointError, ConfigError, load_model
from core.config import MLASpec, YarnRope
from plugins.deepseek import DeepseekV2Config, DeepseekV3Config

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    first_k_dense_replace=1,  # layer 0 dense, layers 1-2 MoE
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=0,
    eos_token_id=1,
)
# DeepSeek-V3 / R1: q_lora, sigmoid noaux_tc routing with a non-zero correction bias over
# 4 groups, one shared expert, YaRN with mscale != mscale_all_dim (cos/sin scaled too).
V3 = dict(
    COMMON,
    model_type="deepseek_v3",
    q_lora_rank=32,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rope_scaling=dict(
        type="yarn",
        factor=4.0,
        original_max_position_embeddings=32,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=0.8,
    ),
)
V3_HUB = dict(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, seq_aux=True)
# DeepSeek-V2-Lite: plain q_proj, softmax greedy routing, two shared experts, no
# renormalisation, YaRN with mscale = mscale_all_dim = 0.707 (softmax scale corrected).
V2_LITE = dict(
    COMMON,
    model_type="deepseek_v2",
    q_lora_rank=None,
    n_routed_experts=8,
    n_shared_experts=2,
    num_experts_per_tok=3,
    n_group=1,
    topk_group=1,
    topk_method="greedy",
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    rope_scaling=dict(
        type="yarn",
        factor=4.0,
        original_max_position_embeddings=32,
        beta_fast=32,
        beta_slow=1,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
)
V2_LITE_HUB = dict(scoring_func="softmax", moe_layer_freq=1, q_lora_rank=None)
# DeepSeek-V2 (236B): q_lora, group-limited greedy routing, a routed scaling factor.
V2 = dict(
    V2_LITE,
    q_lora_rank=32,
    n_group=4,
    topk_group=2,
    topk_method="group_limited_greedy",
    routed_scaling_factor=2.0,
)
V2_HUB = dict(V2_LITE_HUB, q_lora_rank=32)
CASES = {"v3": (V3, V3_HUB), "v2-lite": (V2_LITE, V2_LITE_HUB), "v2": (V2, V2_HUB)}
VOCAB = COMMON["vocab_size"]
TRANSFORMERS_ONLY = ("head_dim", "qk_head_dim", "rope_interleave", "num_mtp_layers")


def set_correction_bias(ref, seed: int = 7, pin_routing: bool = False) -> None:
    """A non-zero e_score_correction_bias (a buffer, which randomize() leaves at zero).

    pin_routing: biases 3 apart (0, 3, 6, ... shuffled, each group a block of consecutive
    ones), so that they alone decide which groups and experts are chosen: the sigmoid scores
    added to them lie in (0, 1), and the groups' top-2 sums are at least 6 apart."""
    g = torch.Generator().manual_seed(seed)
    for layer in ref.model.layers:
        gate = getattr(layer.mlp, "gate", None)  # dense layers have none
        bias = getattr(gate, "e_score_correction_bias", None)
        if bias is None:
            continue
        if not pin_routing:
            bias.copy_(torch.randn(bias.shape, generator=g) * 0.2)
            continue
        groups = ref.config.n_group
        size = bias.numel() // groups  # group j holds 3 * (size * rank_j + a permutation)
        rank = torch.randperm(groups, generator=g)[:, None] * size
        within = torch.stack([torch.randperm(size, generator=g) for _ in range(groups)])
        bias.copy_(3.0 * (rank + within).flatten().float())


def hub_tensors(root, ref, mtp_layers: int) -> None:
    """Rewrite model.safetensors with per-expert names and (V3) trailing MTP layers."""
    path = root / "model.safetensors"
    state, out = load_file(path), {}
    for name, t in state.items():
        stacked = re.fullmatch(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?", name)
        if stacked is None:
            out[name] = t
            continue
        # transformers 5 may store the experts stacked; real checkpoints name each expert
        prefix, kind = stacked.groups()
        for e, w in enumerate(t):
            if kind == "gate_up_proj":
                gate, up = w.chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = (
                    gate,
                    up,
                )
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = w
    n = ref.config.num_hidden_layers
    for i in range(mtp_layers):  # an MTP module: a whole decoder layer plus its own heads
        last = f"model.layers.{n - 1}."
        for name in [k for k in out if k.startswith(last)]:
            out[f"model.layers.{n + i}." + name[len(last) :]] = out[name].clone()
        for extra in ("enorm", "hnorm", "shared_head.norm"):
            out[f"model.layers.{n + i}.{extra}.weight"] = torch.ones(ref.config.hidden_size)
        h = ref.config.hidden_size
        out[f"model.layers.{n + i}.eh_proj.weight"] = torch.zeros(h, 2 * h)
        out[f"model.layers.{n + i}.shared_head.head.weight"] = torch.zeros(VOCAB, h)
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in out)
    save_file({k: v.contiguous() for k, v in out.items()}, path, metadata={"format": "pt"})


def hub_config(root, **changes) -> None:
    path = root / "config.json"
    cfg = {k: v for k, v in json.loads(path.read_text()).items() if k not in TRANSFORMERS_ONLY}
    path.write_text(json.dumps({**cfg, **changes}))


def make_deepseek(root, case: str, mtp_layers: int = 0, pin_routing: bool = False, **changes):
    """Like conftest's make_checkpoint, but keeping q_lora_rank=None (V2-Lite) in the spec.
    `changes` override the case's config keys."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec, hub = CASES[case]
    spec = {**spec, **changes}
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec), dtype=torch.float32)
    ref.eval()
    randomize(ref)
    set_correction_bias(ref, pin_routing=pin_routing)
    ref.save_pretrained(root)
    hub_tensors(root, ref, mtp_layers)
    cfg = hub_style(json.loads((root / "config.json").read_text()), rope_key="type")
    (root / "config.json").write_text(json.dumps(cfg))
    hub_config(root, num_nextn_predict_layers=mtp_layers, **hub, **changes)
    return root, ref


@pytest.fixture(scope="module", params=list(CASES))
def deepseek(request, tmp_path_factory):
    """(loaded model, transformers reference) per case, built once per module."""
    mtp = 1 if request.param == "v3" else 0
    root, ref = make_deepseek(tmp_path_factory.mktemp(request.param), request.param, mtp)
    return load_model(root, max_seq_len=64, max_batch_size=2), ref


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on this module's models."""

    vocab = VOCAB
    prefill_len = 40  # past original_max_position_embeddings

    @pytest.fixture
    def model(self, deepseek):
        return deepseek


def test_cache_holds_the_latent_not_full_kv(deepseek):
    m, ref = deepseek
    cache, c = m.net.kv_cache, ref.config
    assert cache.names == [("latent", "k_pe")] * c.num_hidden_layers  # per layer
    assert len(cache.layers) == c.num_hidden_layers
    latent, k_pe = cache.layer(0)
    assert tuple(latent.shape) == (2, 64, c.kv_lora_rank)
    assert tuple(k_pe.shape) == (2, 64, c.qk_rope_head_dim)
    per_token = c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    assert m.config.kv_bytes_per_token(4) == per_token
    assert cache.nbytes == per_token * 2 * 64


def test_routing_parameters_are_used(deepseek):
    """Zeroing the router (or V3's correction bias) changes the logits: the checks can fail."""
    m, ref = deepseek
    gate = m.net.model.layers[1].mlp.gate
    param = getattr(gate, "e_score_correction_bias", gate.weight)
    assert param.abs().sum() > 0
    x = ids(VOCAB, 1, 12)
    saved = param.detach().clone()
    with torch.no_grad():
        param.zero_()
        try:
            m.reset()
            assert rel_err(m.forward(x), ref(x).logits) > 1e-3
        finally:
            param.copy_(saved)


def deepseek_v2_router(gate, cfg, hidden: torch.Tensor):
    """DeepSeek-V2's own routing (MoEGate.forward in modeling_deepseek.py of the
    deepseek-ai/DeepSeek-V2 hub repo), as (logits, weights, ids) for transformers' MoE block.

    It differs from transformers' DeepseekV2TopkRouter, which always multiplies the top-k
    scores by routed_scaling_factor: with norm_topk_prob and top_k > 1 the top-k scores are
    divided by their sum (+ 1e-20) and NOT scaled; otherwise they are scaled and not divided.
    """
    x = hidden.reshape(-1, hidden.shape[-1]).float()
    logits = x @ gate.weight.float().T
    probs = torch.softmax(logits, dim=-1)  # V2 scores with softmax
    n, k = probs.shape[0], cfg.num_experts_per_tok
    if cfg.topk_method == "group_limited_greedy":  # groups ranked by their best expert
        best = probs.view(n, cfg.n_group, -1).amax(dim=-1)
        kept = torch.zeros_like(best).scatter(1, best.topk(cfg.topk_group, dim=-1)[1], 1.0)
        probs = probs * kept.repeat_interleave(probs.shape[1] // cfg.n_group, dim=1)
    weights, chosen = probs.topk(k, dim=-1)
    if cfg.norm_topk_prob and k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights = weights * cfg.routed_scaling_factor
    return logits, weights, chosen


@pytest.mark.parametrize("top_k", [3, 1])
@torch.no_grad()
def test_v2_norm_topk_prob_follows_deepseeks_code(tmp_path, top_k):
    """DeepSeek V2 with norm_topk_prob: true and routed_scaling_factor 2, which transformers
    does not implement for V2: the reference is transformers' model with its routers replaced
    by DeepSeek's own formula (renormalised and unscaled for top_k > 1, scaled for top_k 1)."""
    root, ref = make_deepseek(tmp_path, "v2", norm_topk_prob=True, num_experts_per_tok=top_k)
    assert ref.config.norm_topk_prob and ref.config.routed_scaling_factor == 2.0
    assert json.loads((root / "config.json").read_text())["norm_topk_prob"] is True
    m = load_model(root, max_seq_len=32)
    x = ids(VOCAB, 1, 20)
    scaled = ref(x).logits  # transformers: the top-k scores times 2, never renormalised
    for layer in ref.model.layers:
        gate = getattr(layer.mlp, "gate", None)  # dense layers have none
        if gate is not None:
            gate.forward = functools.partial(deepseek_v2_router, gate, ref.config)
    want = ref(x).logits
    if top_k > 1:  # renormalising instead of scaling moves the logits visibly
        assert rel_err(want, scaled) > 1e-2
    check_prefill(m, ref, x)


@torch.no_grad()
def test_v3_bf16_close_to_fp32_reference_correction_bias_stays_fp32(tmp_path):
    """V3 loaded in bf16 (its correction bias kept fp32) against the fp32 transformers model
    holding the same bf16-rounded weights, so that what differs is only bf16 arithmetic.

    The routing is pinned (pin_routing): bf16 rounding of a hidden state otherwise flips a
    near-tied expert, a jump in the logits that no tolerance bounds (then a correct bf16 Zoo
    and bf16 transformers both miss fp32 by up to 80% here). The router's own precision is
    test_moe's bf16 router test. Tolerance: bf16 keeps 8 significant bits (2**-9 = 0.2%
    relative per rounding); over this model's 3 layers Zoo's error is 2-3.5% of the largest
    logit (measured over seeds), bf16 transformers' about the same; a wrong op or constant
    (a softmax scale, the YaRN mscale, the routed scaling) costs 10% or more."""
    root, ref = make_deepseek(tmp_path, "v3", mtp_layers=1, pin_routing=True)
    m = load_model(root, dtype="bfloat16", max_seq_len=32, max_batch_size=2)
    gate = m.net.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.dtype == torch.float32
    assert gate.weight.dtype == torch.bfloat16
    for p in ref.parameters():
        p.copy_(p.bfloat16().float())
    x = ids(VOCAB, 2, 24)
    got = m.forward(x)
    assert got.dtype == torch.bfloat16
    assert rel_err(got.cpu(), ref(x).logits) < 5e-2


def test_mtp_layers_skipped_only_when_declared(tmp_path):
    root, _ = make_deepseek(tmp_path, "v3", mtp_layers=1)
    hub_config(root, num_nextn_predict_layers=0)  # layer 3 is now unexplained
    with pytest.raises(CheckpointError, match=r"unexpected \(model\.layers\.3\."):
        load_model(root, max_seq_len=16)


def test_missing_expert_is_named(tmp_path):
    root, _ = make_deepseek(tmp_path, "v2-lite")
    path = root / "model.safetensors"
    state = load_file(path)
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"missing \(model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight\)"
    ):
        load_model(root, max_seq_len=16)


def test_config_specs():
    v3 = DeepseekV3Config.from_dict(dict(V3, **V3_HUB)).to_runtime()
    assert isinstance(v3.attention, MLASpec) and v3.attention.q_lora_rank == 32
    assert isinstance(v3.rope, YarnRope) and v3.rope.interleaved and v3.rope.dim == 8
    assert v3.moe.layers == (1, 2) and v3.layer_mlp(0) is v3.mlp
    assert (v3.moe.scoring, v3.moe.topk_method, v3.moe.num_groups) == ("sigmoid", "noaux_tc", 4)
    lite = DeepseekV2Config.from_dict(dict(V2_LITE, **V2_LITE_HUB)).to_runtime()
    assert lite.attention.q_lora_rank is None and lite.moe.num_shared_experts == 2
    # softmax scale: 1/sqrt(24) * mscale(4, 0.707)^2; rope table scale: mscale / mscale_all_dim
    m = 0.1 * 0.707 * math.log(4.0) + 1.0
    assert lite.attention.scale == pytest.approx(24**-0.5 * m * m, rel=1e-12)
    assert lite.rope.attention_factor == 1.0
    # moe_layer_freq: every other layer from first_k_dense_replace on
    sparse = DeepseekV2Config.from_dict(dict(V2_LITE, num_hidden_layers=6, moe_layer_freq=2))
    assert sparse.to_runtime().moe.layers == (2, 4)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"n_group": 16}, "noaux_tc"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"topk_method": "best"}, "topk_method"),
    ],
)
def test_bad_configs_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        DeepseekV3Config.from_dict({**V3, **V3_HUB, **changes}).to_runtime()


def test_compiled_decode_step_matches_greedy(tmp_path):
    """V3 (MLA with q_lora, noaux_tc MoE) with its decode step compiled: the MoE's expert loop
    breaks the graph, and the tokens still equal transformers'."""
    root, ref = make_deepseek(tmp_path, "v3")
    m = load_model(root, max_seq_len=64, max_batch_size=2, compile=True)
    assert m.step.compiled is not None
    check_greedy(m, ref, ids(VOCAB, 1, 9), n=8)


def test_stacked_experts_as_transformers_5_names_them(tmp_path):
    """A checkpoint written from transformers 5's own state dict: routed experts stacked in
    `mlp.experts.gate_up_proj` / `down_proj` (no `.weight` leaf) fill the core's whole."""
    root, ref = make_deepseek(tmp_path, "v2-lite")
    assert "model.layers.1.mlp.experts.gate_up_proj" in save_in_memory_names(root, ref)
    check_prefill(load_model(root, max_seq_len=32), ref, ids(VOCAB, 1, 20))
