"""YaRN rope: inverse frequencies and attention factor bit-identical to transformers."""

from __future__ import annotations

import pytest
import torch

from core import ConfigError
from core.layers.rope import RotaryEmbedding, attention_factor, inv_freq
from plugins.llama3 import LlamaConfig

BASE = dict(
    model_type="llama",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=1,
    num_attention_heads=4,
    max_position_embeddings=512,
    rope_theta=10000.0,
)
CASES = {
    "qwen2.5 (factor only)": dict(factor=4.0, original_max_position_embeddings=128),
    "deepseek-v3": dict(
        factor=40.0,
        original_max_position_embeddings=64,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    "deepseek-v2-lite": dict(
        factor=40, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=0.707
    ),
    "mscale ratio": dict(
        factor=8.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.5
    ),
    "untruncated, explicit attention_factor": dict(
        factor=2.0,
        original_max_position_embeddings=100,
        beta_fast=16,
        beta_slow=2,
        truncate=False,
        attention_factor=1.25,
    ),
    "transformers 5 layout": dict(
        rope_type="yarn", rope_theta=50000.0, factor=4.0, original_max_position_embeddings=128
    ),
}


def transformers_yarn(raw: dict):
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS["yarn"](HFLlamaConfig(**raw))


@pytest.mark.parametrize("name", list(CASES))
def test_yarn_matches_transformers_bit_for_bit(name):
    params = CASES[name]
    key = "rope_parameters" if "rope_type" in params else "rope_scaling"
    scaling = params if key == "rope_parameters" else {"type": "yarn", **params}
    raw = dict(BASE, **{key: scaling})
    spec = LlamaConfig.from_dict(raw).to_runtime().rope
    want_inv, want_factor = transformers_yarn(raw)
    assert torch.equal(inv_freq(spec), want_inv)
    assert attention_factor(spec) == want_factor


def test_cos_sin_table_carries_the_attention_factor():
    raw = dict(BASE, rope_scaling={"type": "yarn", **CASES["mscale ratio"]})
    spec = LlamaConfig.from_dict(raw).to_runtime().rope
    table = RotaryEmbedding(spec, 32, "cpu")
    cos, sin = table(0, 32, 32)
    freqs = torch.arange(32).float()[:, None] * inv_freq(spec)[None]
    assert attention_factor(spec) != 1.0
    assert torch.equal(cos[0], freqs.cos() * attention_factor(spec))
    assert torch.equal(sin[0], freqs.sin() * attention_factor(spec))


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"original_max_position_embeddings": 64}, "factor"),
        ({"factor": -1.0}, "factor"),
        ({"factor": 4.0, "beta_fast": 1, "beta_slow": 32}, "beta_fast"),
    ],
)
def test_bad_yarn_params_name_the_field(params, field):
    raw = dict(BASE, rope_scaling={"type": "yarn", **params})
    with pytest.raises(ConfigError, match=field):
        LlamaConfig.from_dict(raw).to_runtime()
