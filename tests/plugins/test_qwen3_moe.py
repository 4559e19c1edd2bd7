"""Qwen3-MoE parity against transformers on tiny random checkpoints (fp32).

Per-head q/k RMSNorm and an explicit head_dim (Qwen3's attention), softmax top-k routing with
and without norm_topk_prob, dense layers picked by mlp_only_layers and decoder_sparse_step.
Two checkpoint layouts: the hub's (`mlp.experts.E.gate_proj.weight`, as transformers'
save_pretrained still writes them) and transformers 5's in-memory one (experts stacked in
`mlp.experts.gate_up_proj` / `down_proj`, no `.weight` leaf).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_checkpoint, save_in_memory_names
from parity import (
    ParitySuite,
    check_decode,
    check_greedy,
    check_prefill,
    check_ragged_batch,
    ids,
    rel_err,
)
from safetensors.torch import load_file, save_file

from core import CheckpointError, ConfigError, load_model
from core.config import DenseMLPSpec, MoESpec
from plugins.qwen3_moe import Qwen3MoeConfig

# Qwen3-30B-A3B-style: head_dim 24 != hidden / heads, 6 experts top-3 renormalised, layer 0
# dense through mlp_only_layers
QWEN3_MOE = dict(
    model_type="qwen3_moe",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    num_experts=6,
    num_experts_per_tok=3,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[0],
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    use_sliding_window=False,
    sliding_window=None,
    max_window_layers=3,
    bos_token_id=1,
    eos_token_id=2,
)
# every other layer MoE (decoder_sparse_step 2: layer 1 of 0-2), weights not renormalised,
# tied embeddings, experts stacked as transformers 5 holds them
SPARSE_STEP = dict(
    QWEN3_MOE, decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False, num_experts=4,
    num_experts_per_tok=2, tie_word_embeddings=True,
)  # fmt: skip
CASES = {"a3b-hub": (QWEN3_MOE, "hub"), "step2-stacked": (SPARSE_STEP, "stacked")}
VOCAB = QWEN3_MOE["vocab_size"]


def make_qwen3_moe(root, spec: dict, layout: str = "hub"):
    root, ref = make_checkpoint(root, spec)
    names = load_file(root / "model.safetensors")
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in names)
    if layout == "stacked":  # transformers 5's own parameter names
        tied = ("lm_head.weight",) if spec["tie_word_embeddings"] else ()
        assert "model.layers.1.mlp.experts.gate_up_proj" in save_in_memory_names(root, ref, tied)
    return root, ref


@pytest.fixture(scope="module", params=list(CASES))
def qwen3_moe(request, tmp_path_factory):
    """(loaded model, transformers reference) per case, built once per module."""
    spec, layout = CASES[request.param]
    root, ref = make_qwen3_moe(tmp_path_factory.mktemp(request.param), spec, layout)
    return load_model(root, max_seq_len=64, max_batch_size=2), ref


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on this module's models."""

    vocab = VOCAB
    prefill_len = 40

    @pytest.fixture
    def model(self, qwen3_moe):
        return qwen3_moe


@torch.no_grad()
def test_sliding_window_matches_transformers(tmp_path):
    """use_sliding_window slides every layer in transformers' Qwen3-MoE, max_window_layers
    notwithstanding (Qwen3's dense model would slide only layers >= it): window 5, prefill
    8x the window, decode past it, greedy from a prompt 3x it, a ragged batch straddling it."""
    spec = dict(QWEN3_MOE, use_sliding_window=True, sliding_window=5, max_window_layers=2)
    root, ref = make_qwen3_moe(tmp_path, spec)
    m = load_model(root, max_seq_len=64, max_batch_size=2)
    assert [a.window for a in m.config.attention_layers] == [5, 5, 5]
    check_prefill(m, ref, ids(VOCAB, 2, 40))
    check_decode(m, ref, ids(VOCAB, 1, 20), prefill=13)
    check_greedy(m, ref, ids(VOCAB, 1, 15, seed=3))
    check_ragged_batch(m, ref, VOCAB, lengths=(4, 16), steps=3, new=8)


def test_dense_and_moe_layers_follow_the_config(qwen3_moe):
    """The layers transformers builds dense are dense here, the others route; q/k norms and
    the router are loaded and matter (zeroing one moves the logits past the parity bar)."""
    m, ref = qwen3_moe
    for layer, want in zip(m.net.model.layers, ref.model.layers, strict=True):
        assert hasattr(layer.mlp, "gate") == hasattr(want.mlp, "gate")
    moe = m.config.moe.layers
    assert moe == ((1, 2) if m.config.moe.norm_topk_prob else (1,))
    attn = m.net.model.layers[moe[0]]
    x = ids(VOCAB, 1, 12)
    for param in (attn.mlp.gate.weight, attn.self_attn.k_norm.weight):
        saved = param.detach().clone()
        with torch.no_grad():
            param.zero_()
            try:
                m.reset()
                assert rel_err(m.forward(x), ref(x).logits) > 1e-3
            finally:
                param.copy_(saved)


def test_config_spec():
    cfg = Qwen3MoeConfig.from_dict(QWEN3_MOE).to_runtime()
    moe = cfg.moe
    assert isinstance(moe, MoESpec) and moe.layers == (1, 2)
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (6, 3, 24)
    assert (moe.scoring, moe.topk_method, moe.norm_topk_prob) == ("softmax", "greedy", True)
    assert moe.num_shared_experts == 0 and moe.routed_scaling_factor == 1.0
    assert cfg.layer_mlp(0) == DenseMLPSpec(80)
    assert cfg.attention.head_dim == 24 and cfg.attention.qk_norm is not None
    step = dict(QWEN3_MOE, num_hidden_layers=8, mlp_only_layers=[3], decoder_sparse_step=2)
    assert Qwen3MoeConfig.from_dict(step).to_runtime().moe.layers == (1, 5, 7)
    # transformers 5 writes num_experts as num_local_experts
    raw = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    assert (
        Qwen3MoeConfig.from_dict({**raw, "num_local_experts": 5}).to_runtime().moe.num_experts == 5
    )
    # no experts, or no layer left to route: a dense model, as transformers builds it
    assert Qwen3MoeConfig.from_dict(dict(QWEN3_MOE, num_experts=0)).to_runtime().moe is None
    assert Qwen3MoeConfig.from_dict(dict(QWEN3_MOE, decoder_sparse_step=4)).to_runtime().moe is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_experts_per_tok": 7}, r"'num_experts_per_tok' \(7\) exceeds num_experts \(6\)"),
        ({"mlp_only_layers": [0, 3]}, r"'mlp_only_layers' names layers \[3\]"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"num_experts": -1}, "num_experts"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ],
)
def test_bad_configs_name_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        Qwen3MoeConfig.from_dict({**QWEN3_MOE, **changes}).to_runtime()


@pytest.mark.parametrize("key", ["intermediate_size", "hidden_size", "vocab_size"])
def test_missing_key_is_named(key):
    raw = {k: v for k, v in QWEN3_MOE.items() if k != key}
    with pytest.raises(ConfigError, match=f"missing required field '{key}'"):
        Qwen3MoeConfig.from_dict(raw).to_runtime()


def test_missing_expert_and_q_norm_are_named(tmp_path):
    root, _ = make_qwen3_moe(tmp_path, QWEN3_MOE)
    path = root / "model.safetensors"
    state = load_file(path)
    del state["model.layers.2.mlp.experts.4.up_proj.weight"]
    del state["model.layers.0.self_attn.q_norm.weight"]
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_model(root, max_seq_len=16)
    assert "model.layers.2.mlp.experts.4.up_proj.weight" in str(err.value)
    assert "model.layers.0.self_attn.q_norm.weight" in str(err.value)


def test_a_checkpoint_with_the_wrong_dense_layers_is_refused(tmp_path):
    """mlp_only_layers decides the parameters: a config that says otherwise than the weights
    fails to load, naming the tensors, instead of running the wrong MLP."""
    root, _ = make_qwen3_moe(tmp_path, QWEN3_MOE)
    path = root / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "mlp_only_layers": []}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj"):
        load_model(root, max_seq_len=16)


def test_registry_shape_is_qwen3_30b_a3b():
    """registry.yaml's `qwen3-moe` shape builds (on the meta device) the published 30.5B model."""
    from core.hub import named_models
    from core.modeling import CausalLM

    entry = named_models()["qwen3-moe"]
    assert entry["repo"] == "Qwen/Qwen3-30B-A3B"
    cfg = Qwen3MoeConfig.from_dict(entry["shape"]).to_runtime()
    assert cfg.moe.layers == tuple(range(48)) and cfg.attention.head_dim == 128
    with torch.device("meta"):
        net = CausalLM(cfg)
    assert f"{sum(p.numel() for p in net.parameters()) / 1e9:.1f}B" == entry["params"] == "30.5B"
