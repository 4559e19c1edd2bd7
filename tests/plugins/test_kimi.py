"""Kimi K2 (`kimi_k2`) and Kimi K2.5 (`kimi_k25`, its text model) on the DeepSeek V3 path: a tiny
DeepSeek V3 checkpoint saved with Kimi's config keys (model_type kimi_k2, DeepseekV3ForCausalLM,
one expert group, routed_scaling_factor 2.827, YaRN with beta_fast = beta_slow = 1 and mscale =
mscale_all_dim, no MTP layer), and the same wrapped as K2.5 (text_config, language_model.*
names, a vision tower and projector to skip), match transformers' DeepseekV3 (fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from parity import ParitySuite, check_decode, check_prefill, ids
from safetensors.torch import load_file, save_file
from test_deepseek import VOCAB, make_deepseek

from core import ConfigError, load_model

# Kimi K2's routing and rope, at the tiny size of test_deepseek's V3
KIMI = dict(
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.827,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32,
                      beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
)  # fmt: skip
KIMI_KEYS = dict(
    model_type="kimi_k2",
    architectures=["DeepseekV3ForCausalLM"],
    auto_map={
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    num_nextn_predict_layers=0,
)


def make_kimi(root, k25: bool):
    """The tiny V3 as Kimi ships it; `k25`: wrapped as a Kimi K2.5 checkpoint."""
    root, ref = make_deepseek(root, "v3", **KIMI)
    cfg = {**json.loads((root / "config.json").read_text()), **KIMI_KEYS}
    if k25:
        cfg = {
            "model_type": "kimi_k25",
            "architectures": ["KimiK25ForConditionalGeneration"],
            "text_config": cfg,
            "vision_config": {"model_type": "moonvit3d"},
        }
        path = root / "model.safetensors"
        state = {f"language_model.{k}": v for k, v in load_file(path).items()}
        state["vision_tower.patch_embed.proj.weight"] = torch.zeros(4, 3, 2, 2)
        state["mm_projector.proj.0.weight"] = torch.zeros(8, 4)
        save_file(state, path, metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(cfg))
    return root, ref


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root, ref = make_kimi(tmp_path_factory.mktemp("kimi_k2"), k25=False)
    return load_model(root, max_seq_len=64, max_batch_size=2), ref


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on Kimi K2."""

    vocab = VOCAB

    @pytest.fixture
    def model(self, kimi):
        return kimi


def test_kimi_k2_is_deepseek_v3(kimi):
    m, _ = kimi
    cfg = m.net.config
    assert cfg.model_type == "kimi_k2" and cfg.mtp_layers == 0
    assert cfg.moe.topk_method == "noaux_tc" and cfg.moe.num_groups == 1
    assert cfg.moe.routed_scaling_factor == 2.827


@torch.no_grad()
def test_kimi_k25_text_model_matches(tmp_path):
    """K2.5: the text model under language_model.*, the vision tower and projector skipped."""
    root, ref = make_kimi(tmp_path, k25=True)
    m = load_model(root, max_seq_len=64, max_batch_size=2)
    assert m.net.config.model_type == "kimi_k25"
    check_prefill(m, ref, ids(VOCAB, 2, 20))
    check_decode(m, ref, ids(VOCAB, 1, 16), prefill=10)


def test_kimi_k25_int4_weights_are_refused():
    from plugins.kimi import KimiK25Config

    text = dict(KIMI_KEYS, hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB,
                intermediate_size=96, num_attention_heads=4,
                quantization_config={"quant_method": "compressed-tensors"})  # fmt: skip
    with pytest.raises(ConfigError, match=r"text_config.quantization_config.*compressed-tensors"):
        KimiK25Config.from_dict({"model_type": "kimi_k25", "text_config": text})
    with pytest.raises(ConfigError, match=r"text_config.model_type.*'llama'"):
        KimiK25Config.from_dict({"model_type": "kimi_k25", "text_config": {"model_type": "llama"}})


def test_registry_shape_is_kimi_k2():
    """registry.yaml's `kimi-k2` shape: 384 experts after one dense layer (its parameter
    count: tests/core/test_registry_shapes.py)."""
    from core.hub import named_models
    from plugins.kimi import KimiK2Config

    entry = named_models()["kimi-k2"]
    cfg = KimiK2Config.from_dict(entry["shape"]).to_runtime()
    assert cfg.moe.num_experts == 384 and cfg.moe.layers == tuple(range(1, 61))
