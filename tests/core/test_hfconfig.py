"""The config DTO: every key style seen on the hub, and every invalid case, by field name."""

from __future__ import annotations

import pytest
from conftest import LLAMA32

from core import ConfigError
from core.config import DefaultRope, DynamicRope, LinearRope, Llama3Rope
from plugins.llama3 import LlamaConfig

BASE = {k: v for k, v in LLAMA32.items() if v is not None}


def runtime(**changes):
    raw = {**BASE, **changes}
    return LlamaConfig.from_dict({k: v for k, v in raw.items() if v is not ...}).to_runtime()


def test_derived_fields():
    cfg = runtime()
    a = cfg.attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.kv_groups) == (4, 2, 16, 2)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2, 3) and cfg.dtype == "bfloat16"
    assert cfg.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2


def test_head_dim_derived_when_absent():
    cfg = runtime(head_dim=..., hidden_size=64)
    assert cfg.attention.head_dim == 16 and cfg.rope.dim == 16


def test_kv_heads_default_to_heads():
    assert runtime(num_key_value_heads=...).attention.num_kv_heads == 4


@pytest.mark.parametrize("key", ["type", "rope_type"])
def test_rope_scaling_type_or_rope_type(key):
    rope = runtime(rope_scaling={key: "linear", "factor": 4.0}).rope
    assert isinstance(rope, LinearRope) and rope.factor == 4.0 and rope.theta == 500000.0


def test_llama3_rope_fields():
    rope = runtime().rope
    assert isinstance(rope, Llama3Rope)
    assert (rope.factor, rope.low_freq_factor, rope.high_freq_factor) == (32.0, 1.0, 4.0)
    assert rope.original_max_position_embeddings == 16


def test_dynamic_rope_remembers_max_positions():
    rope = runtime(rope_scaling={"rope_type": "dynamic", "factor": 2.0}).rope
    assert isinstance(rope, DynamicRope) and rope.max_position_embeddings == 128


def test_transformers5_rope_parameters():
    cfg = runtime(
        rope_theta=...,
        rope_scaling=...,
        rope_parameters={"rope_type": "default", "rope_theta": 123.0},
    )
    assert type(cfg.rope) is DefaultRope and cfg.rope.theta == 123.0


def test_rope_theta_defaults_like_transformers():
    assert runtime(rope_theta=..., rope_scaling=None).rope.theta == 10000.0


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_dtype_either_key(key):
    raw = {k: v for k, v in BASE.items() if k != "torch_dtype"}
    raw[key] = "float16"
    assert LlamaConfig.from_dict(raw).to_runtime().dtype == "float16"


def test_eos_int_or_list_and_flags():
    cfg = runtime(eos_token_id=7, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    assert cfg.eos_token_ids == (7,)
    assert cfg.attention.qkv_bias and cfg.attention.o_bias and cfg.mlp.bias
    assert not cfg.tie_word_embeddings


def test_unknown_keys_ignored():
    assert runtime(some_future_key={"x": 1}, architectures=["LlamaForCausalLM"]).vocab_size == 96


def test_runtime_config_is_frozen():
    cfg = runtime()
    with pytest.raises(AttributeError):
        cfg.vocab_size = 1


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"hidden_size": ...}, ["missing", "hidden_size"]),
        ({"num_hidden_layers": 0}, ["num_hidden_layers", "greater than 0"]),
        ({"vocab_size": -5}, ["vocab_size"]),
        ({"rms_norm_eps": "tiny"}, ["rms_norm_eps"]),
        ({"eos_token_id": "x"}, ["eos_token_id"]),
        ({"hidden_act": "relu"}, ["hidden_act", "silu"]),
        ({"head_dim": ..., "hidden_size": 50}, ["hidden_size (50)", "num_attention_heads (4)"]),
        ({"num_key_value_heads": 3}, ["num_key_value_heads (3)"]),
        ({"rope_scaling": {"rope_type": "wavy"}}, ["rope_scaling.rope_type", "'wavy'", "llama3"]),
        ({"rope_scaling": {"rope_type": "linear"}}, ["rope_scaling", "factor", "missing"]),
        ({"rope_scaling": {"rope_type": "linear", "factor": -1}}, ["factor"]),
        (
            {"rope_scaling": {**BASE["rope_scaling"], "high_freq_factor": 0.5}},
            ["high_freq_factor", "low_freq_factor"],
        ),
        ({"rope_theta": -1.0}, ["rope_theta"]),
        ({"torch_dtype": "int8"}, ["torch_dtype", "int8"]),
    ],
)
def test_invalid_configs_name_the_field(changes, words):
    with pytest.raises(ConfigError) as exc:
        runtime(**changes)
    for w in words:
        assert w in str(exc.value)


def test_not_a_dict():
    with pytest.raises(ConfigError, match="JSON object"):
        LlamaConfig.from_dict(["not", "a", "dict"])
