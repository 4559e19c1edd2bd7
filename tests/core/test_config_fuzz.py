"""Random config.json dicts through every architecture's DTO: a valid RuntimeConfig or a
ZooError, never another exception. Bounded so `make test` stays fast."""

from __future__ import annotations

from conftest import LLAMA32
from hypothesis import given, settings
from hypothesis import strategies as st

from core import ZooError
from core.config import RuntimeConfig
from core.plugins import registry

DEEPSEEK = dict(
    LLAMA32,
    model_type="deepseek_v3",
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    first_k_dense_replace=1,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
)
BASES = [
    LLAMA32,
    dict(LLAMA32, model_type="qwen2"),
    DEEPSEEK,
    dict(DEEPSEEK, model_type="deepseek_v2"),
    dict(LLAMA32, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    dict(
        LLAMA32, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0]
    ),
]

scalars = st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats() | st.text(max_size=8)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def configs(draw):
    base = dict(draw(st.sampled_from(BASES)))
    keys = sorted(base)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["set", "drop", "add", "rope"]))
        if action == "set":
            base[draw(st.sampled_from(keys))] = draw(json_values)
        elif action == "drop":
            base.pop(draw(st.sampled_from(keys)), None)
        elif action == "add":
            base[draw(st.text(max_size=10))] = draw(json_values)
        else:  # a plausible rope block with one wrong or odd value
            kind = draw(st.sampled_from(["linear", "dynamic", "llama3", "yarn", "su", None]))
            base["rope_scaling"] = {
                draw(st.sampled_from(["type", "rope_type"])): kind,
                draw(st.sampled_from(["factor", "low_freq_factor", "beta_fast", "mscale"])): draw(
                    json_values
                ),
            }
    return base


@settings(max_examples=300, deadline=None)
@given(raw=configs())
def test_random_configs_give_a_runtime_config_or_a_zoo_error(raw):
    try:
        arch = registry().architecture(raw.get("model_type"))
        cfg = arch.config.from_dict(raw).to_runtime()
    except ZooError:
        return
    assert isinstance(cfg, RuntimeConfig)
    assert cfg.hidden_size > 0 and cfg.num_layers > 0 and cfg.vocab_size > 0
