"""DeepSeek V4 parity against transformers on a tiny random checkpoint (fp32).

The checkpoint is rewritten the way the hub ships it: DeepSeek's own tensor names
(`layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`, `hc_head_fn`, an `mtp.0.*`
layer) and config.json with the legacy keys (`compress_ratios`, `num_hash_layers`,
`qk_rope_head_dim`, a flat YaRN `rope_scaling`). Every feature is sized to change the logits of
a 20-token prompt: a 6-token window, CSA every 4 tokens with the indexer keeping 2 entries,
HCA every 8, a hash-routed first layer, a SwiGLU clamp of 0.5.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import randomize
from fixtures.families import DEEPSEEK_V4 as SPEC
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import ParitySuite, check_prefill, ids, rel_err
from safetensors.torch import load_file, save_file

from core import load_model
from core.config import YarnRope
from core.config_kinds import CompressedAttentionSpec
from plugins.deepseek_v4 import DeepseekV4Config

VOCAB = 128
# what the hub's config.json says instead of transformers 5's keys
HUB_CONFIG = dict(
    compress_ratios=[0, 4, 128, 0],  # one more: the MTP layer's
    compress_rates=SPEC["compress_rates"],
    num_hash_layers=1,
    qk_rope_head_dim=8,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_scaling={
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    scoring_func="sqrtsoftplus",
    topk_method="noaux_tc",
    torch_dtype="float32",
)
TRANSFORMERS_ONLY = (
    "layer_types",
    "mlp_layer_types",
    "rope_parameters",
    "partial_rotary_factor",
    "dtype",
    "compress_rates",
)
SCALARS = st.none() | st.booleans() | st.integers(-3, 300) | st.floats() | st.text(max_size=6)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=6,
)
HUB_NAMES = [  # transformers' save_pretrained names -> the hub's (DeepSeek's own)
    (r"^model\.embed_tokens\.", "embed."),
    (r"^model\.hc_head\.hc_", "hc_head_"),
    (r"^model\.", ""),
]


def make_v4(root, hub: bool = True):
    """A tiny random V4 (and the transformers model it came from) under root; `hub`: hub
    names and config keys, else as transformers 5 saves it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("deepseek_v4", **SPEC)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(ref)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in ref.model.layers:  # randomize() leaves buffers: a table, a bias
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                pick = [torch.randperm(8, generator=g)[:2] for _ in range(VOCAB)]
                gate.tid2eid.copy_(torch.stack(pick))
            else:
                gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.2)
    ref.save_pretrained(root)
    if hub:
        path = root / "model.safetensors"
        state = {}
        for name, t in load_file(path).items():
            for pattern, new in HUB_NAMES:
                name = re.sub(pattern, new, name)
            state[name] = t
        state["mtp.0.attn.wq_a.weight"] = torch.zeros(32, 64)
        save_file(state, path, metadata={"format": "pt"})
        cfg = json.loads((root / "config.json").read_text())
        cfg = {k: v for k, v in cfg.items() if k not in TRANSFORMERS_ONLY}
        (root / "config.json").write_text(json.dumps({**cfg, **HUB_CONFIG}))
    return root, ref


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    root, ref = make_v4(tmp_path_factory.mktemp("dsv4"))
    return load_model(root, max_seq_len=32, max_batch_size=2), ref, root


class TestParity(ParitySuite):
    vocab = VOCAB
    decode = (20, 9)  # decoding across CSA and HCA window boundaries

    @pytest.fixture
    def model(self, v4):
        return v4


def test_config_reads_the_hubs_legacy_keys(v4):
    m = v4[0]
    layers = m.config.attention_layers
    assert all(isinstance(s, CompressedAttentionSpec) for s in layers)
    assert [s.compress_rate for s in layers] == [0, 4, 8]
    assert [s.index_topk for s in layers] == [0, 0 + 2, 0]
    assert layers[0].rope.theta == 10000.0 and not isinstance(layers[0].rope, YarnRope)
    assert layers[1].rope.theta == 160000.0 and layers[1].rope.attention_factor == 1.0
    assert m.config.moe.hash_layers == (0,) and m.config.hyper_connections.mult == 3


def test_transformers_names_and_keys_load_too(tmp_path):
    """What transformers 5 saves (nested rope_parameters, layer_types, its names) loads."""
    root, ref = make_v4(tmp_path, hub=False)
    check_prefill(load_model(root, max_seq_len=32), ref, ids(VOCAB, 1, 20))


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": 64},  # every token in the window
        {"index_topk": 64},  # the indexer keeps every entry
        {"compress_ratios": [0, 0, 0]},  # no compressed entries at all
        {"swiglu_limit": 100.0},  # no clamping
        {"hc_sinkhorn_iters": 1},
    ],
)
@torch.no_grad()
def test_each_feature_moves_the_logits(v4, tmp_path, change):
    """Switched off, each feature changes the logits: the parity checks exercise it."""
    _, ref, root = v4
    for f in root.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((root / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    if "compress_ratios" in change:  # no compressors: their tensors are not loaded
        state = load_file(tmp_path / "model.safetensors")
        state = {k: v for k, v in state.items() if ".compressor." not in k and ".indexer." not in k}
        save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    m = load_model(tmp_path, max_seq_len=32)
    x = ids(VOCAB, 1, 20)
    assert rel_err(m.forward(x), ref(x).logits) > 1e-3


@torch.no_grad()
def test_hash_routing_and_sinks_are_used(v4):
    m, ref, _ = v4
    x = ids(VOCAB, 1, 20)
    for param in (m.net.model.layers[0].mlp.gate.tid2eid, m.net.model.layers[1].self_attn.sinks):
        saved = param.detach().clone()
        param.copy_(param.flip(0))
        try:
            m.reset()
            assert rel_err(m.forward(x), ref(x).logits) > 1e-3
        finally:
            param.copy_(saved)


def test_the_fused_cpu_step_refuses_it(v4):
    from core.cpu_step import why_not

    assert why_not(v4[0].net) == "block 0 is HyperBlock"


def test_cache_keeps_projections_per_token(v4):
    m = v4[0]
    assert m.net.kv_cache.names == [
        ("kv",),
        ("kv", "ckv", "cgate", "ikv", "igate"),
        ("kv", "ckv", "cgate"),
    ]
    # per token: 32 (kv) x 3, CSA 2 x 2 x 32 + 2 x 2 x 16, HCA 2 x 32; fp32
    assert m.config.kv_bytes_per_token(4) == (3 * 32 + 128 + 64 + 64) * 4


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"compress_ratios": [0, 3]}, "compress_ratios"),
        ({"layer_types": ["full_attention"] * 43}, "layer_types"),
        ({"mlp_layer_types": ["dense"] * 43}, "mlp_layer_types"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"o_groups": 3}, "o_groups"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_scaling"),
    ],
)
def test_bad_config_names_the_key(change, key):
    from core import ConfigError

    with pytest.raises(ConfigError, match=key):
        DeepseekV4Config.from_dict({"model_type": "deepseek_v4", **change}).to_runtime()


def test_registry_shape_is_deepseek_v4_flash():
    """registry.yaml's `deepseek-v4` shape builds (on the meta device) the published 284B."""
    from core.hub import named_models
    from core.modeling import CausalLM

    entry = named_models()["deepseek-v4"]
    assert entry["repo"] == "deepseek-ai/DeepSeek-V4-Flash"
    cfg = DeepseekV4Config.from_dict(entry["shape"]).to_runtime()
    rates = [s.compress_rate for s in cfg.attention_layers]
    assert rates == [0, 0] + [4, 128] * 20 + [4] and cfg.moe.hash_layers == (0, 1, 2)
    with torch.device("meta"):
        net = CausalLM(cfg)
    assert f"{sum(p.numel() for p in net.parameters()) / 1e9:.1f}B" == entry["params"] == "284.3B"


def test_zoo_info_names_the_layer_kinds(v4):
    """`zoo info`'s layer kinds: each layer's own name for its kind (V4's specs carry an
    index_topk, as DSA's do, but are not DeepSeek sparse attention)."""
    from core.cli.info import _layer_kinds

    m, _, _ = v4
    want = "window 6 x 1, window 6 + CSA 4 (top 2) x 1, window 6 + HCA 8 x 1"
    assert _layer_kinds(m.config) == want


def test_bench_random_weights_route_hash_layers_by_expert_ids():
    """`zoo bench --random-weights`: the hash table holds k distinct expert ids per token, not
    noise (which truncated to expert 0 for every token and slot)."""
    from core.cli.bench import random_model

    shape = dict(SPEC, model_type="deepseek_v4")
    m = random_model(shape, device="cpu", dtype="float32", max_seq_len=16, max_batch_size=1)
    table = m.net.model.layers[0].mlp.gate.tid2eid.long()  # (vocab, top_k)
    assert (table[:, 0] != table[:, 1]).all() and set(table.unique().tolist()) == set(range(8))


@torch.no_grad()
def test_queries_by_chunks_match(v4, monkeypatch):
    """A prompt longer than the attention's query chunk (made 3 here) gives the same logits."""
    import core.layers.compressed

    m, ref, _ = v4
    monkeypatch.setattr(core.layers.compressed, "CHUNK", 3)
    check_prefill(m, ref, ids(VOCAB, 2, 20))


@torch.no_grad()
def test_hyper_connection_matches_transformers_module():
    """The Sinkhorn-normalised stream weights and the head's collapse, module against module
    (random streams of 4 x 64, 20 Sinkhorn steps: V4's)."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    from core.config_kinds import HyperConnectionSpec
    from core.layers.hyper import HyperConnection, HyperHead

    config = AutoConfig.for_model("deepseek_v4", **dict(SPEC, hc_mult=4, hc_sinkhorn_iters=20))
    spec = HyperConnectionSpec(4, 20, config.hc_eps, config.rms_norm_eps)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 4, 64, generator=g)
    for theirs, ours in ((hf.DeepseekV4HyperConnection(config), HyperConnection(64, spec)),
                         (hf.DeepseekV4HyperHead(config), HyperHead(64, spec))):  # fmt: skip
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        ours.load_state_dict(theirs.state_dict())
        want, got = theirs(x), ours(x)  # (post, comb, collapsed), or the head's collapse
        want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
        for w, o in zip(want, got, strict=True):
            assert rel_err(o, w) < 1e-5


FUZZ_BASE = {**{k: v for k, v in SPEC.items() if k != "rope_parameters"}, **HUB_CONFIG}
FUZZ_BASE.update(model_type="deepseek_v4", compress_ratios=[0, 4, 128])


@st.composite
def v4_configs(draw):
    raw = dict(FUZZ_BASE)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(raw)))
        action = draw(st.sampled_from(["set", "drop", "rope"]))
        if action == "set":
            raw[key] = draw(JSON_VALUES)
        elif action == "drop":
            raw.pop(key)
        else:  # a yarn block with one odd value
            odd = draw(st.sampled_from(["factor", "beta_fast", "rope_theta", "type"]))
            raw["rope_scaling"] = {**HUB_CONFIG["rope_scaling"], odd: draw(JSON_VALUES)}
    return raw


@settings(max_examples=150, deadline=None)
@given(raw=v4_configs())
def test_random_configs_give_a_runtime_config_or_a_config_error(raw):
    from core import ZooError

    try:
        cfg = DeepseekV4Config.from_dict(raw).to_runtime()
    except ZooError:
        return
    assert cfg.num_layers == len(cfg.attention_layers) > 0


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e8m0(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The power-of-two exponents that bring amax under `top` (e4m3: 448, e2m1: 6)."""
    return torch.ceil(torch.log2(amax.clamp(min=1e-30) / top)).clamp(-127, 127)


def to_fp8(w: torch.Tensor):
    """(fp8 weight, e8m0 block scale, the weight it stands for): one 128 x 128 block here."""
    e = e8m0(w.abs().max().reshape(1, 1), 448.0)
    q = (w / torch.exp2(e)).to(torch.float8_e4m3fn)
    return q, (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu), q.float() * torch.exp2(e)


def to_fp4(w: torch.Tensor):
    """(packed I8 codes, e8m0 scale per 32 values, the weight they stand for)."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // 32, 32)
    e = e8m0(groups.abs().amax(-1), 6.0)  # (rows, groups)
    x = groups / torch.exp2(e)[..., None]
    code = (x.abs()[..., None] - E2M1).abs().argmin(-1) + 8 * (x < 0)  # sign in bit 3
    value = E2M1[code % 8] * torch.where(code >= 8, -1.0, 1.0) * torch.exp2(e)[..., None]
    code = code.reshape(rows, cols).to(torch.uint8)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.int8)
    scale = (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return packed, scale, value.reshape(rows, cols)


QUANTIZED = {  # what the hub's V4 config.json declares
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    "expert_dtype": "fp4",
}  # fmt: skip


@torch.no_grad()
def test_deepseeks_fp8_and_fp4_weights_load_dequantized(v4, tmp_path):
    """The hub's own form: fp8 attention projections with 128 x 128 e8m0 block scales, fp4
    routed experts with an e8m0 scale per 32 values (`X.weight` + `X.scale`). They load to the
    logits of the same model stored as the floats they stand for."""
    _, _, root = v4
    state = load_file(root / "model.safetensors")
    quantized, floats = dict(state), dict(state)
    for name, w in state.items():
        if re.search(r"\.attn\.(wq_a|wq_b|wkv|wo_b)\.weight$", name):
            q, scale, back = to_fp8(w)
        elif re.search(r"\.ffn\.experts\.\d+\.w[123]\.weight$", name):
            q, scale, back = to_fp4(w)
        else:
            continue
        quantized[name], quantized[name.removesuffix("weight") + "scale"] = q, scale
        floats[name] = back
    folders, config = {}, json.loads((root / "config.json").read_text())
    for kind, tensors in (("quantized", quantized), ("floats", floats)):
        folder = tmp_path / kind
        folder.mkdir()
        (folder / "config.json").write_text(
            json.dumps({**config, **QUANTIZED} if kind == "quantized" else config)
        )
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        folders[kind] = load_model(folder, max_seq_len=32)
    x = ids(VOCAB, 1, 20)
    want = folders["floats"].forward(x)
    assert rel_err(folders["quantized"].forward(x), want) < 1e-6
    assert rel_err(want, load_model(root, max_seq_len=32).forward(x)) > 1e-3  # they quantized


@torch.no_grad()
def test_bfloat16_keeps_transformers_fp32_parts(v4):
    """In bf16 the parts transformers keeps in fp32 stay fp32 (norm weights, hyper-connections,
    sinks, position biases), and the logits stay near the fp32 reference."""
    _, ref, root = v4
    m = load_model(root, max_seq_len=32, dtype="bfloat16")
    layer = m.net.model.layers[1]
    kept = (layer.input_layernorm.weight, layer.self_attn.kv_norm.weight, layer.attn_hc.fn,
            layer.self_attn.sinks, layer.self_attn.compressor.position_bias)  # fmt: skip
    assert all(p.dtype == torch.float32 for p in kept)
    assert layer.self_attn.q_b_proj.weight.dtype == torch.bfloat16
    x = ids(VOCAB, 1, 20)
    assert rel_err(m.forward(x), ref(x).logits) < 5e-2
