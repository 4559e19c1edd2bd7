"""DeepSeek V3.2 and GLM-5 (DeepSeek sparse attention on MLA) against transformers, on tiny
random checkpoints in fp32.

index_topk (5) is well below the prompts' lengths, so the indexer's top-k selection decides
which keys each query reads; a test checks that it moves the logits (and that with
index_topk >= the sequence the model is plain MLA). Checkpoints carry per-expert names and an
MTP layer, config.json the hub's key style (rope_theta, V3.2's rope_scaling with `type`, GLM-5's
indexer_rope_interleave, GLM-5.1's index_topk_freq schedule instead of indexer_types).
"""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch
from conftest import hub_style, randomize
from fixtures.families import DEEPSEEK_V32 as V32
from fixtures.families import GLM5 as GLM
from parity import ParitySuite, check_prefill, ids, rel_err
from test_deepseek import hub_tensors, set_correction_bias

from core import ConfigError, load_model
from core.config_kinds import SparseMLASpec
from core.cpu_step import why_not
from plugins.deepseek_v32 import DeepseekV32Config, GlmMoeDsaConfig

VOCAB = 128
TOPK = V32["index_topk"]
HUB = {
    "deepseek_v32": dict(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1),
    "glm_moe_dsa": dict(
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        moe_layer_freq=1,
        indexer_rope_interleave=True,
        index_topk_freq=2,
        index_skip_topk_offset=1,
    ),
}
# transformers 5 writes these out; the hub's configs do not carry them
TRANSFORMERS_ONLY = ("head_dim", "qk_head_dim", "layer_types", "mlp_layer_types", "indexer_types")
CASES = {"v3.2": V32, "glm-5": GLM}


def make_dsa(root, spec: dict, mtp_layers: int = 1):
    """A tiny transformers model from `spec`, saved as the hub ships it: (folder, model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec), dtype=torch.float32)
    ref.eval()
    randomize(ref)
    set_correction_bias(ref)
    ref.save_pretrained(root)
    hub_tensors(root, ref, mtp_layers)
    cfg = hub_style(json.loads((root / "config.json").read_text()), rope_key="type")
    cfg = {k: v for k, v in cfg.items() if k not in TRANSFORMERS_ONLY}
    cfg.update(HUB[spec["model_type"]], num_nextn_predict_layers=mtp_layers)
    (root / "config.json").write_text(json.dumps(cfg))
    return root, ref


@pytest.fixture(scope="module", params=list(CASES))
def dsa(request, tmp_path_factory):
    root, ref = make_dsa(tmp_path_factory.mktemp(request.param), CASES[request.param])
    return load_model(root, max_seq_len=64, max_batch_size=2), ref, root


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py, the top-k well below every prompt."""

    vocab = VOCAB
    ragged: ClassVar[dict] = dict(lengths=(7, 12), steps=3, new=4)  # both rows past the top-k

    @pytest.fixture
    def model(self, dsa):
        return dsa


def test_cache_holds_the_indexer_keys(dsa):
    m, ref, _ = dsa
    c = ref.config
    full = [i for i in range(c.num_hidden_layers) if getattr(c, "indexer_types", None) is None
            or c.indexer_types[i] == "full"]  # fmt: skip
    names = m.net.kv_cache.names
    assert [i for i, n in enumerate(names) if n == ("latent", "k_pe", "index_k")] == full
    assert all(n in {("latent", "k_pe"), ("latent", "k_pe", "index_k")} for n in names)
    per_token = c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim)
    per_token += len(full) * c.index_head_dim
    assert m.config.kv_bytes_per_token(4) == per_token * 4
    assert m.net.kv_cache.nbytes == per_token * 4 * 2 * 64


def test_fused_cpu_step_refuses_sparse_attention(dsa):
    m = dsa[0]
    assert (
        why_not(m.net) == "block 0 is DeepSeek sparse attention (top-5 keys), not the fused step's"
    )
    assert m.step.fused.why_not() is not None  # so greedy decoding (TestParity) ran the modules


@torch.no_grad()
def test_no_layer_keeps_its_selection_after_a_forward(dsa):
    """A selection is (B, T, S) booleans per indexer layer (64 MiB for an 8k prompt; V3.2 has
    61 layers): only a layer that shares it keeps it, and only until its last reader ran."""
    m = dsa[0]
    m.forward(ids(VOCAB, 1, 12))
    kept = [i for i, b in enumerate(m.net.model.layers) if b.self_attn.selected is not None]
    assert kept == []


@torch.no_grad()
def test_top_k_selection_moves_the_logits(dsa, tmp_path):
    """With index_topk >= the prompt, DSA is plain MLA (equal to transformers' V3 on the same
    weights); at 5 of 20 keys the logits move, and both still match transformers."""
    m, ref, root = dsa
    x = ids(VOCAB, 1, 20)
    sparse = m.forward(x)
    cfg = json.loads((root / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "index_topk": 64}))
    (tmp_path / "model.safetensors").symlink_to(root / "model.safetensors")
    dense = load_model(tmp_path, max_seq_len=32)
    ref.config.index_topk = 64
    for layer in ref.model.layers:
        if getattr(layer.self_attn, "indexer", None) is not None:
            layer.self_attn.indexer.index_topk = 64
    try:
        check_prefill(dense, ref, x)
    finally:
        ref.config.index_topk = TOPK
        for layer in ref.model.layers:
            if getattr(layer.self_attn, "indexer", None) is not None:
                layer.self_attn.indexer.index_topk = TOPK
    assert rel_err(sparse, dense.forward(x)) > 1e-2


def test_config_specs():
    v32 = DeepseekV32Config.from_dict(dict(V32, **HUB["deepseek_v32"])).to_runtime()
    a = v32.attention
    assert isinstance(a, SparseMLASpec) and (a.index_heads, a.index_topk) == (8, TOPK)
    assert not a.index_rope_interleaved and v32.rope.interleaved
    assert v32.moe.layers == (1, 2) and v32.mtp_layers == 1
    glm = GlmMoeDsaConfig.from_dict(dict(GLM, **HUB["glm_moe_dsa"])).to_runtime()
    assert [s.shared_selection for s in glm.attention_layers] == [False, True, False, True]
    assert glm.attention.index_rope_interleaved
    pattern = GlmMoeDsaConfig.from_dict(dict(GLM, index_topk_pattern="FFSF")).to_runtime()
    assert [s.shared_selection for s in pattern.attention_layers] == [False, False, True, False]
    plain = GlmMoeDsaConfig.from_dict(dict(GLM, index_topk_freq=1)).to_runtime()
    assert not any(s.shared_selection for s in plain.attention_layers)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"index_head_dim": 4}, "index_head_dim"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"mlp_layer_types": ["dense"]}, "mlp_layer_types"),
    ],
)
def test_bad_configs_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        DeepseekV32Config.from_dict({**V32, **changes}).to_runtime()


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"indexer_types": ["shared", "full", "full", "full"]}, "indexer_types"),
        ({"indexer_types": ["full"]}, "indexer_types"),
        ({"index_topk_pattern": "FXSF"}, "index_topk_pattern"),
    ],
)
def test_bad_glm_schedules_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        GlmMoeDsaConfig.from_dict({**GLM, **changes}).to_runtime()


@pytest.mark.parametrize(
    ("name", "repo", "config"),
    [
        ("deepseek-v3.2", "deepseek-ai/DeepSeek-V3.2", DeepseekV32Config),
        ("glm-5", "zai-org/GLM-5", GlmMoeDsaConfig),
    ],
)
def test_registry_entries_are_sparse_attention(name, repo, config):
    """registry.yaml's DSA shapes (their parameter counts: tests/core/test_registry_shapes.py,
    DeepSeek V3.2's 671B without its 14B MTP layer, GLM-5's 744B likewise)."""
    from core.hub import named_models

    entry = named_models()[name]
    assert entry["repo"] == repo
    cfg = config.from_dict(entry["shape"]).to_runtime()
    assert all(isinstance(s, SparseMLASpec) for s in cfg.attention_layers)
    assert not any(s.shared_selection for s in cfg.attention_layers)
    assert cfg.attention.index_topk == 2048 and cfg.mtp_layers == 1
