"""Mixtral parity against transformers on tiny random checkpoints (fp32).

Two checkpoint layouts: the hub's (`block_sparse_moe.experts.E.w1/w2/w3`, as transformers'
save_pretrained still writes them) and transformers 5's in-memory one (`mlp.gate`, experts
stacked in `mlp.experts.gate_up_proj` / `down_proj`, no `.weight` leaf).
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
from plugins.mixtral import MixtralConfig

# Mixtral-8x7B-style: GQA 4/2 heads, 4 experts, top-2, untied head, rope_theta 1e6, no window
MIXTRAL = dict(
    model_type="mixtral",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=1e6,
    sliding_window=None,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
# top-1 of 3 (the weight renormalises to 1), explicit head_dim, transformers 5's stacked layout
TOP1 = dict(MIXTRAL, num_local_experts=3, num_experts_per_tok=1, head_dim=24)
CASES = {"top2-hub": (MIXTRAL, "hub"), "top1-stacked": (TOP1, "stacked")}
VOCAB = MIXTRAL["vocab_size"]


def make_mixtral(root, spec: dict, layout: str = "hub"):
    root, ref = make_checkpoint(root, spec)
    cfg = json.loads((root / "config.json").read_text())
    if cfg.get("head_dim") is None:
        del cfg["head_dim"]  # Mixtral's hub configs have no head_dim key
    (root / "config.json").write_text(json.dumps(cfg))
    names = load_file(root / "model.safetensors")
    assert any(".block_sparse_moe.experts.0.w1.weight" in k for k in names)
    if layout == "stacked":  # transformers 5's own parameter names
        assert "model.layers.0.mlp.experts.gate_up_proj" in save_in_memory_names(root, ref)
    return root, ref


@pytest.fixture(scope="module", params=list(CASES))
def mixtral(request, tmp_path_factory):
    """(loaded model, transformers reference) per case, built once per module."""
    spec, layout = CASES[request.param]
    root, ref = make_mixtral(tmp_path_factory.mktemp(request.param), spec, layout)
    return load_model(root, max_seq_len=64, max_batch_size=2), ref


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on this module's models."""

    vocab = VOCAB
    prefill_len = 40

    @pytest.fixture
    def model(self, mixtral):
        return mixtral


@torch.no_grad()
def test_sliding_window_matches_transformers(tmp_path):
    """A window of 5 tokens on every layer (Mistral v0.1's kind): prefill 8x the window,
    decode past it, greedy from a prompt 3x it, a ragged batch straddling it."""
    spec = dict(MIXTRAL, sliding_window=5)
    root, ref = make_mixtral(tmp_path, spec)
    assert ref.config.sliding_window == 5
    m = load_model(root, max_seq_len=64, max_batch_size=2)
    assert [a.window for a in m.config.attention_layers] == [5, 5]
    check_prefill(m, ref, ids(VOCAB, 2, 40))
    check_decode(m, ref, ids(VOCAB, 1, 20), prefill=13)
    check_greedy(m, ref, ids(VOCAB, 1, 15, seed=3))
    check_ragged_batch(m, ref, VOCAB, lengths=(4, 16), steps=3, new=8)
    # the window is honoured: full attention gives other logits on this sequence
    x = ids(VOCAB, 1, 30)
    m.reset()
    got = m.forward(x)
    root_full, _ = make_mixtral(tmp_path / "full", MIXTRAL)
    full = load_model(root_full, max_seq_len=64)
    assert rel_err(full.forward(x), got) > 1e-3


def test_every_layer_routes_and_the_router_matters(mixtral):
    """Every layer is MoE; zeroing a router changes the logits, so the checks above can fail."""
    m, ref = mixtral
    assert m.config.moe.layers == (0, 1)
    gate = m.net.model.layers[1].mlp.gate
    assert torch.equal(gate.weight, ref.model.layers[1].mlp.gate.weight)
    x = ids(VOCAB, 1, 12)
    saved = gate.weight.detach().clone()
    with torch.no_grad():
        gate.weight.zero_()
        try:
            m.reset()
            assert rel_err(m.forward(x), ref(x).logits) > 1e-3
        finally:
            gate.weight.copy_(saved)


def test_config_spec():
    cfg = MixtralConfig.from_dict(MIXTRAL).to_runtime()
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (4, 2, 48)
    assert (moe.scoring, moe.topk_method, moe.norm_topk_prob) == ("softmax", "greedy", True)
    assert moe.num_shared_experts == 0 and moe.routed_scaling_factor == 1.0
    assert cfg.rope.theta == 1e6 and cfg.attention.num_kv_heads == 2
    assert [a.window for a in cfg.attention_layers] == [None, None]  # sliding_window: null
    # transformers 5 reads num_experts as an alias of num_local_experts
    alias = {k: v for k, v in MIXTRAL.items() if k != "num_local_experts"}
    assert MixtralConfig.from_dict({**alias, "num_experts": 6}).to_runtime().moe.num_experts == 6


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_experts_per_tok": 5}, r"'num_experts_per_tok' \(5\) exceeds num_local_experts"),
        ({"num_local_experts": 0}, "num_local_experts"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_bad_configs_name_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        MixtralConfig.from_dict({**MIXTRAL, **changes}).to_runtime()


@pytest.mark.parametrize("key", ["intermediate_size", "hidden_size", "num_hidden_layers"])
def test_missing_key_is_named(key):
    raw = {k: v for k, v in MIXTRAL.items() if k != key}
    with pytest.raises(ConfigError, match=f"missing required field '{key}'"):
        MixtralConfig.from_dict(raw).to_runtime()


def test_missing_expert_is_named_by_its_hub_name(tmp_path):
    root, _ = make_mixtral(tmp_path, MIXTRAL)
    path = root / "model.safetensors"
    state = load_file(path)
    del state["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"missing \(model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\."
    ):
        load_model(root, max_seq_len=16)


def test_registry_shape_is_mixtral_8x7b():
    """registry.yaml's `mixtral` shape builds (on the meta device) the published 46.7B model."""
    from core.hub import named_models
    from core.modeling import CausalLM

    entry = named_models()["mixtral"]
    assert entry["repo"] == "mistralai/Mixtral-8x7B-Instruct-v0.1"
    with torch.device("meta"):
        net = CausalLM(MixtralConfig.from_dict(entry["shape"]).to_runtime())
    assert f"{sum(p.numel() for p in net.parameters()) / 1e9:.1f}B" == entry["params"] == "46.7B"
