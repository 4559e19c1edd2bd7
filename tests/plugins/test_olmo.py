"""OLMo 2 and OLMo 3 against transformers on tiny random checkpoints (fp32): norms after each
sub-block only, q/k norms over all heads (GQA 4/2, so q_norm and k_norm differ in width), and
for OLMo 3 window layers (window 5, shorter than the test sequences) with plain rope beside
YaRN full layers, in the hub's key style (rope_theta + rope_scaling, no layer_types) and in
transformers 5's (layer_types, rope_parameters per layer kind)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_checkpoint
from parity import ParitySuite, ids, rel_err

from core import load_model
from core.config import DefaultRope, YarnRope
from core.cpu_step import why_not

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    eos_token_id=1,
)
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.2079441541679836}  # fmt: skip
OLMO2 = dict(BASE, model_type="olmo2", num_hidden_layers=2, rope_theta=1000.0)
# OLMo 3 as the releases spell it: layers 0-2 windowed, 3 full; YaRN (release values, a short
# original length) on the full layer; the window layers keep transformers' default theta
OLMO3_HUB = dict(
    BASE, model_type="olmo3", num_hidden_layers=4, sliding_window=5, rope_theta=1000.0,
    rope_scaling=YARN,
)  # fmt: skip
# transformers 5's keys: one rope block per kind, the window layers at their own theta
OLMO3_V5 = dict(
    BASE,
    model_type="olmo3",
    num_hidden_layers=4,
    sliding_window=5,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_parameters={
        "full_attention": {**YARN, "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
)
SPECS = {"olmo2": OLMO2, "olmo3-hub": OLMO3_HUB, "olmo3-v5": OLMO3_V5}
VOCAB = BASE["vocab_size"]


def save(root, spec: dict):
    """The checkpoint with config.json in the spec's own key style (the shared hub_style
    rewrite would flatten transformers 5's per-kind rope blocks)."""
    root, ref = make_checkpoint(root, spec, raw=True)
    cfg = json.loads((root / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "layer_types"):
        cfg.pop(key, None)
    cfg.update({k: spec[k] for k in spec if k.startswith("rope") or k == "layer_types"})
    (root / "config.json").write_text(json.dumps(cfg))
    return root, ref


@pytest.fixture(scope="module", params=list(SPECS))
def olmo(request, tmp_path_factory):
    root, ref = save(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    return load_model(root, max_seq_len=64, max_batch_size=2), ref, request.param


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on this module's models."""

    vocab = VOCAB

    @pytest.fixture
    def model(self, olmo):
        return olmo


def test_layers_and_ropes(olmo):
    """Post-norms only, q/k norms as wide as all heads; OLMo 3's window layers on plain rope
    (default theta 500000 in the hub style, their own in transformers 5's), YaRN elsewhere."""
    m, _, name = olmo
    cfg = m.net.config
    assert not cfg.pre_norms and cfg.post_norms
    attn = m.net.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (64,) and attn.k_norm.weight.shape == (32,)
    assert "pre-norms" in why_not(m.net)
    if name == "olmo2":
        assert all(s.window is None for s in cfg.attention_layers)
        return
    windows = [s.window for s in cfg.attention_layers]
    assert windows == ([5, 5, 5, None] if name == "olmo3-hub" else [5, None, 5, None])
    assert isinstance(cfg.rope, YarnRope) and cfg.rope.theta == 1000.0
    local = cfg.layer_rope(0)
    assert type(local) is DefaultRope
    assert local.theta == (500000.0 if name == "olmo3-hub" else 100.0)


@pytest.mark.parametrize("olmo", ["olmo3-hub", "olmo3-v5"], indirect=True)  # OLMo 2: neither
@torch.no_grad()
def test_windows_and_local_rope_matter(olmo):
    """The same weights without windows give other logits (the window bites on the test
    prompts), and so does the model's rope on the window layers: the checks above can fail."""
    from transformers import AutoModelForCausalLM

    m, ref, _ = olmo
    x = ids(VOCAB, 1, 16)
    want = ref(x).logits
    config = type(ref.config).from_dict({**ref.config.to_dict(), "sliding_window": 1000})
    wide = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    wide.load_state_dict(ref.state_dict())
    assert rel_err(wide(x).logits, want) > 1e-3
    keep = list(m.net.rope_of_layer)
    m.net.rope_of_layer = [keep[-1]] * len(keep)
    try:
        m.reset()
        assert rel_err(m.forward(x), want) > 1e-3
    finally:
        m.net.rope_of_layer = keep
    m.reset()
    assert rel_err(m.forward(x), want) < 1e-4


def test_registry_shape_is_olmo3_7b():
    """registry.yaml's `olmo3` shape: three window layers to one full (its parameter count:
    tests/core/test_registry_shapes.py)."""
    from core.hub import named_models
    from plugins.olmo import Olmo3Config

    entry = named_models()["olmo3"]
    cfg = Olmo3Config.from_dict(entry["shape"]).to_runtime()
    assert [s.window for s in cfg.attention_layers[:4]] == [4096, 4096, 4096, None]


@pytest.mark.parametrize("name", ["olmo3-hub"])  # one conversion: ~10 s of imports
def test_gguf_file_of_llama_cpps_converter_equals_the_checkpoint(name, tmp_path):
    """llama.cpp writes OLMo 2 and 3 as `olmo2` (OLMo 3: with a window and its pattern, the
    window layers' rope base as freq_base_swa): the F32 file loads as the checkpoint does."""
    from fixtures.chat_tokenizers import build_tokenizer_folder
    from fixtures.llama_cpp_convert import convert

    folder = tmp_path / "hf"
    special = build_tokenizer_folder(folder, "qwen2")
    save(folder, dict(SPECS[name], vocab_size=320, eos_token_id=special["<|im_end|>"]))
    path = convert(folder, tmp_path / "f32.gguf")
    kw = dict(max_seq_len=64, max_batch_size=1, dtype="float32")
    ours, theirs = load_model(path, **kw), load_model(folder, **kw)
    assert ours.config.model_type == theirs.config.model_type == name.split("-")[0]
    assert ours.config.attention_layers == theirs.config.attention_layers
    x = ids(320, 1, 20)
    assert rel_err(ours.forward(x), theirs.forward(x)) < 1e-4


@torch.no_grad()
def test_norm_rounds_as_olmo_in_bf16():
    """RMSNormSpec(fp32_scale=True) scales the fp32 normed x by the weight, then casts back, as
    transformers' OLMo norm: bit-equal in bf16 (Llama's rounding casts first and differs)."""
    from transformers.models.olmo3.modeling_olmo3 import Olmo3RMSNorm

    from core.config import RMSNormSpec
    from core.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 7, 64, generator=g) * 3).bfloat16()
    w = (0.5 + torch.rand(64, generator=g)).bfloat16()
    theirs = Olmo3RMSNorm(64, eps=1e-6).bfloat16()
    ours, llama = RMSNorm(64, RMSNormSpec(1e-6, fp32_scale=True)), RMSNorm(64, RMSNormSpec(1e-6))
    for norm in (theirs, ours, llama):
        norm.to(torch.bfloat16).weight.copy_(w)
    assert torch.equal(ours(x), theirs(x))
    assert not torch.equal(llama(x), theirs(x))


def test_tensor_parallelism_is_refused():
    """The q/k norm spans every rank's heads: tp > 1 is refused, naming it; tp=1 runs."""
    from core import ConfigError
    from core.parallel.tp import check
    from plugins.olmo import Olmo3Config

    cfg = Olmo3Config.from_dict(OLMO3_HUB).to_runtime()
    check(cfg, 1, "config.json")
    with pytest.raises(ConfigError, match=r"q/k norm over all heads.*tp=1"):
        check(cfg, 2, "config.json")


def test_gguf_olmo2_metadata_without_a_window_is_olmo2():
    """An olmo2 file without attention.sliding_window is an OLMo 2: its flat rope keys kept,
    YaRN's stored attention factor added; with a window but no pattern, OLMo 3's default."""
    from pathlib import Path

    from plugins.formats.gguf_archs import ARCHITECTURES

    configure = ARCHITECTURES["olmo2"].configure
    meta = {"rope.scaling.yarn_attn_factor": 1.25}
    yarn = {"rope_type": "yarn", "factor": 8.0}
    cfg = configure(meta.get, {"rope_theta": 1000.0, "rope_scaling": yarn}, Path("f.gguf"))
    assert cfg == {"rope_theta": 1000.0, "rope_scaling": {**yarn, "attention_factor": 1.25}}
    cfg = configure(meta.get, dict(cfg, num_hidden_layers=4, sliding_window=5), Path("f.gguf"))
    assert cfg["model_type"] == "olmo3" and "layer_types" not in cfg
    local = cfg["rope_parameters"]["sliding_attention"]
    assert local == {"rope_type": "default", "rope_theta": 1000.0}  # no freq_base_swa: freq_base
