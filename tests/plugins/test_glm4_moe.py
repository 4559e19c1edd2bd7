"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`) parity against transformers on tiny random checkpoints (fp32).

GQA with q/k/v biases (o without), per-head q/k RMSNorm (`use_qk_norm`), rope on half of each
head (`partial_rotary_factor`), a dense first layer (`first_k_dense_replace`), a shared expert,
sigmoid noaux_tc routing with a non-zero correction bias over groups, and a trailing MTP layer.
The checkpoints are written the way the hub ships them: per-expert tensor names, the MTP layer
after the decoder's, config.json in transformers 4's key style (top-level
`partial_rotary_factor`, `rope_theta`, `num_nextn_predict_layers`).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hub_style, randomize, save_in_memory_names
from parity import ParitySuite, check_prefill, ids, rel_err
from safetensors.torch import load_file, save_file

from core import CheckpointError, ConfigError, load_model
from core.config import GQASpec
from core.cpu_step import why_not
from plugins.glm4_moe import Glm4MoeConfig

VOCAB = 128
# GLM-4.5 / 4.6 / 4.7-style: q/k norm, groups (4 of 8 experts' groups, 2 kept), a routed scale
GLM45 = dict(
    model_type="glm4_moe",
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    first_k_dense_replace=1,  # layer 0 dense, layers 1-2 MoE
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    partial_rotary_factor=0.5,  # 8 of 16 dims rotate
    attention_bias=True,
    use_qk_norm=True,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)
# GLM-4.5-Air-style: no q/k norm, one group, scale 1, two shared experts
AIR = dict(GLM45, use_qk_norm=False, n_group=1, topk_group=1, routed_scaling_factor=1.0,
           n_shared_experts=2)  # fmt: skip
# as transformers 5 saves it: partial_rotary_factor only in rope_parameters (a quarter here),
# the routed experts stacked (mlp.experts.gate_up_proj, no .weight leaf), no MTP layer
T5 = dict(GLM45, partial_rotary_factor=0.25)
CASES = {"glm-4.5": (GLM45, "hub"), "air": (AIR, "hub"), "transformers-5": (T5, "stacked")}
TRANSFORMERS_ONLY = ("rope_parameters", "num_mtp_layers")


def set_correction_bias(ref, seed: int = 7) -> None:
    """A non-zero e_score_correction_bias (a buffer, which randomize() leaves at zero)."""
    g = torch.Generator().manual_seed(seed)
    for layer in ref.model.layers:
        gate = getattr(layer.mlp, "gate", None)  # the dense layer has none
        if gate is not None:
            gate.e_score_correction_bias.copy_(torch.randn(gate.weight.shape[0], generator=g))


def add_mtp_layer(root, ref) -> None:
    """Append an MTP module as the hub stores it: a copy of the last layer as layer n, plus
    its own norms and projections."""
    path = root / "model.safetensors"
    out = load_file(path)
    n, h = ref.config.num_hidden_layers, ref.config.hidden_size
    last = f"model.layers.{n - 1}."
    for name in [k for k in out if k.startswith(last)]:
        out[f"model.layers.{n}." + name[len(last) :]] = out[name].clone()
    for extra in ("enorm", "hnorm", "shared_head.norm"):
        out[f"model.layers.{n}.{extra}.weight"] = torch.ones(h)
    out[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(h, 2 * h)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in out  # the hub's names
    save_file({k: v.contiguous() for k, v in out.items()}, path, metadata={"format": "pt"})


def make_glm(root, spec: dict, mtp: int = 1, layout: str = "hub", **hub):
    """Save a random transformers GLM-4-MoE under root as the hub ships it (`layout` "hub"),
    or as transformers 5 holds it ("stacked": its config.json and in-memory names, no MTP
    layer); `hub` overrides config.json keys. Returns (folder, transformers model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec), dtype=torch.float32)
    ref.eval()
    randomize(ref)
    set_correction_bias(ref)
    ref.save_pretrained(root)
    if layout == "stacked":
        assert "model.layers.1.mlp.experts.gate_up_proj" in save_in_memory_names(root, ref)
        assert "partial_rotary_factor" not in json.loads((root / "config.json").read_text())
        return root, ref
    if mtp:
        add_mtp_layer(root, ref)
    cfg = hub_style(json.loads((root / "config.json").read_text()))
    cfg = {k: v for k, v in cfg.items() if k not in TRANSFORMERS_ONLY}
    cfg.update(partial_rotary_factor=spec["partial_rotary_factor"], num_nextn_predict_layers=mtp)
    (root / "config.json").write_text(json.dumps({**cfg, **hub}))
    return root, ref


@pytest.fixture(scope="module", params=list(CASES))
def glm(request, tmp_path_factory):
    """(loaded model, transformers reference) per case, built once per module."""
    spec, layout = CASES[request.param]
    root, ref = make_glm(tmp_path_factory.mktemp(request.param), spec, layout=layout)
    return load_model(root, max_seq_len=64, max_batch_size=2), ref


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on this module's models."""

    vocab = VOCAB

    @pytest.fixture
    def model(self, glm):
        return glm


@torch.no_grad()
def test_each_feature_moves_the_logits(glm):
    """Zeroing the correction bias, the router, a k norm or a q/k/v bias moves the logits
    past the parity bar: each is loaded and used, so the parity checks could fail."""
    m, ref = glm
    layer = m.net.model.layers[1]
    params = [layer.mlp.gate.e_score_correction_bias, layer.mlp.gate.weight,
              layer.self_attn.qkv_proj.bias]  # fmt: skip
    if m.config.attention.qk_norm is not None:
        params.append(layer.self_attn.k_norm.weight)
    x = ids(VOCAB, 1, 12)
    for param in params:
        saved = param.detach().clone()
        param.zero_()
        try:
            m.reset()
            assert rel_err(m.forward(x), ref(x).logits) > 1e-3
        finally:
            param.copy_(saved)


def test_rotary_dims_are_transformers(glm):
    """Rope turns as many dims of each head as transformers' rope table holds (the top-level
    key in the hub's config.json, rope_parameters' in transformers 5's)."""
    m, ref = glm
    assert m.config.rope.dim == int(16 * ref.config.rope_parameters["partial_rotary_factor"])


@torch.no_grad()
def test_partial_rotary_factor_is_read(tmp_path):
    """The same weights with rope on every dim (factor 1) no longer match: the half-rotated
    head is what transformers computes."""
    root, ref = make_glm(tmp_path, GLM45, partial_rotary_factor=1.0)
    m = load_model(root, max_seq_len=32)
    assert m.config.rope.dim == 16 and not m.config.rope.interleaved
    x = ids(VOCAB, 1, 16)
    assert rel_err(m.forward(x), ref(x).logits) > 1e-3


def test_fused_cpu_step_takes_glm(glm):
    """Every GLM feature is one the fused CPU decode step computes (partial rope, q/k/v
    biases without an o bias, per-head q/k norms, grouped noaux_tc routing): it runs the
    model, and the parity suite's greedy and ragged checks go through it."""
    m, _ = glm
    assert why_not(m.net) is None


def test_config_spec():
    cfg = Glm4MoeConfig.from_dict(GLM45).to_runtime()
    a = cfg.attention
    assert isinstance(a, GQASpec) and (a.qkv_bias, a.o_bias) == (True, False)
    assert a.qk_norm is not None and a.head_dim == 16
    assert cfg.rope.dim == 8 and not cfg.rope.interleaved
    moe = cfg.moe
    assert moe.layers == (1, 2) and cfg.layer_mlp(0).intermediate_size == 96
    assert (moe.scoring, moe.topk_method, moe.num_groups, moe.topk_groups) == (
        "sigmoid", "noaux_tc", 4, 2)  # fmt: skip
    assert (moe.norm_topk_prob, moe.routed_scaling_factor) == (True, 2.5)
    assert moe.shared_width == 24 and cfg.mtp_layers == 1
    # top-1 is still renormalised (weight 1 * scale), as transformers' router does
    top1 = Glm4MoeConfig.from_dict(dict(GLM45, num_experts_per_tok=1)).to_runtime()
    assert top1.moe.norm_topk_prob
    # transformers 5 spells the MTP count num_mtp_layers; absent, partial_rotary_factor is 0.5
    raw = {k: v for k, v in GLM45.items() if k != "partial_rotary_factor"}
    cfg = Glm4MoeConfig.from_dict({**raw, "num_mtp_layers": 0}).to_runtime()
    assert cfg.mtp_layers == 0 and cfg.rope.dim == 8


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"n_group": 3}, "n_group"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    ],
)
def test_bad_configs_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        Glm4MoeConfig.from_dict({**GLM45, **changes}).to_runtime()


def test_mtp_layer_skipped_only_when_declared(tmp_path):
    root, _ = make_glm(tmp_path, AIR, num_nextn_predict_layers=0)  # layer 3 is unexplained
    with pytest.raises(CheckpointError, match=r"unexpected \(model\.layers\.3\."):
        load_model(root, max_seq_len=16)


@torch.no_grad()
def test_bf16_keeps_router_bias_fp32(tmp_path):
    root, ref = make_glm(tmp_path, AIR, mtp=0)
    m = load_model(root, dtype="bfloat16", max_seq_len=16)
    gate = m.net.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.dtype == torch.float32
    check_prefill(load_model(root, max_seq_len=16), ref, ids(VOCAB, 1, 10))


@pytest.mark.parametrize(
    ("name", "repo", "first_moe", "qk_norm"),
    [("glm-4.5-air", "zai-org/GLM-4.5-Air", 1, False), ("glm-4.6", "zai-org/GLM-4.6", 3, True)],
)
def test_registry_shapes_are_glms(name, repo, first_moe, qk_norm):
    """registry.yaml's GLM shapes read as GLM's: dense first layers, half-rotated heads of 128,
    q/k norms on 4.6 only, the MTP layer skipped (tests/core/test_registry_shapes.py checks
    their parameter counts: 106.9B and 352.8B without it, 106B and 355B on the cards)."""
    from core.hub import named_models

    entry = named_models()[name]
    assert entry["repo"] == repo and entry["architecture"] == "glm4_moe"
    cfg = Glm4MoeConfig.from_dict(entry["shape"]).to_runtime()
    assert cfg.moe.layers[0] == first_moe and cfg.rope.dim == 64 and cfg.mtp_layers == 1
    assert (cfg.attention.qk_norm is not None) == qk_norm
