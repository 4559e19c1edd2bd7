"""Llama 4 parity against transformers on tiny random checkpoints (fp32).

Chunks of 4 tokens and a temperature floor of 2 tokens, so that both change the logits of the
short test prompts; interleaved rope with Llama 3 scaling, L2 q/k norms, NoPE
layers, top-k sigmoid routing that scales the experts' inputs, a shared expert.
- scout: `llama4_text`, experts on every layer, top-1, layer 3 NoPE, no `layer_types` key;
- maverick: experts on every other layer (dense `intermediate_size_mlp` between), top-2, no
  q/k norm, `no_rope_layers` spelled out, transformers 5's `layer_types` kept;
- multimodal: a `llama4` repo (Llama4ForConditionalGeneration) whose vision model is skipped.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import hub_style, make_checkpoint, randomize
from fixtures.families import LLAMA4_SCOUT as SCOUT
from parity import ParitySuite, check_decode, check_prefill, ids, rel_err

from core import ConfigError, load_model
from core.cpu_step import why_not
from plugins.llama4 import Llama4Config, Llama4TextConfig

VOCAB = 128
MAVERICK = dict(
    SCOUT,
    interleave_moe_layer_step=2,
    num_experts_per_tok=2,
    use_qk_norm=False,
    no_rope_layers=[1, 0, 1, 1],
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)
SPECS = {"scout": SCOUT, "maverick": MAVERICK}


def make_llama4(root, spec: dict):
    root, ref = make_checkpoint(root, spec)
    if spec is SCOUT:  # as the released configs: no layer_types, which the roped layers chunk
        path = root / "config.json"
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items()
                                    if k != "layer_types"}))  # fmt: skip
    return root, ref


@pytest.fixture(scope="module", params=list(SPECS))
def llama4(request, tmp_path_factory):
    root, ref = make_llama4(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    return load_model(root, max_seq_len=64, max_batch_size=2), ref


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on this module's models."""

    vocab = VOCAB

    @pytest.fixture
    def model(self, llama4):
        return llama4


@torch.no_grad()
def test_several_tokens_at_per_row_positions(llama4):
    """Three tokens per row after a ragged prefill (a verify step's shape): each row's chunks
    are its own (rows at 3 and 6 cross a chunk boundary at different tokens)."""
    m, ref = llama4
    rows = ids(VOCAB, 2, 9, seed=5)
    lengths = torch.tensor([3, 6])
    m.reset()
    m.forward(rows[:, :6], lengths=lengths)
    nxt = torch.stack([rows[r, n : n + 3] for r, n in enumerate(lengths.tolist())])
    got = m.forward(nxt, lengths)
    for r, n in enumerate(lengths.tolist()):
        want = ref(rows[r : r + 1, : n + 3]).logits[0, n:]
        assert rel_err(got[r], want) < 1e-4


def test_layers_follow_the_config(llama4):
    """Chunks on the roped layers, temperature on the NoPE ones, q/k norms where asked,
    experts where transformers puts them; the fused CPU step refuses the model."""
    m, ref = llama4
    want = ref.config
    for i, layer in enumerate(m.net.model.layers):
        spec = layer.self_attn.spec
        roped = bool(want.no_rope_layers[i])
        assert (spec.rope != "none") == roped
        assert spec.chunk == (4 if want.layer_types[i] == "chunked_attention" else None)
        assert (spec.query_scale is not None) == (not roped)
        assert (spec.qk_norm is not None) == (roped and want.use_qk_norm)
        assert hasattr(layer.mlp, "gate") == (i in want.moe_layers)
    assert "chunked attention" in why_not(m.net)
    # past the chunks: the weightless q/k norm (scout), else the temperature, then the experts
    attns = [layer.self_attn for layer in m.net.model.layers]
    keep = [a.spec for a in attns]
    norm = want.use_qk_norm
    try:
        for a in attns:
            a.spec = replace(a.spec, chunk=None)
        assert ("L2Norm" if norm else "scales queries by position") in why_not(m.net)
        for a in attns:
            a.spec = replace(a.spec, query_scale=None)
        assert ("L2Norm" if norm else "MoE weights its experts' inputs") in why_not(m.net)
    finally:
        for a, spec in zip(attns, keep, strict=True):
            a.spec = spec


@pytest.mark.parametrize("change", [{"chunk": None}, {"query_scale": None}])
def test_each_feature_moves_the_logits(llama4, change):
    """Switching a feature off gives other logits on the test prompts: each is exercised."""
    feature_moves_the_logits(llama4, change)


@pytest.mark.parametrize("llama4", ["scout"], indirect=True)  # Maverick has no q/k norm
def test_the_qk_norm_moves_the_logits(llama4):
    feature_moves_the_logits(llama4, {"qk_norm": None})


@torch.no_grad()
def feature_moves_the_logits(llama4, change: dict) -> None:
    m, ref = llama4
    x = ids(VOCAB, 1, 14)
    layers = [layer.self_attn for layer in m.net.model.layers]
    field = next(iter(change))
    touched = [a for a in layers if getattr(a.spec, field) not in (None, False)]
    assert touched
    keep = [a.spec for a in touched]
    try:
        for a in touched:
            a.spec = replace(a.spec, **change)
        m.reset()
        assert rel_err(m.forward(x), ref(x).logits) > 1e-3
    finally:
        for a, spec in zip(touched, keep, strict=True):
            a.spec = spec
    m.reset()
    assert rel_err(m.forward(x), ref(x).logits) < 1e-4


@torch.no_grad()
def test_routing_weights_scale_the_expert_input(llama4):
    """Weighting the experts' outputs instead (Mixtral's way) gives other logits."""
    m, ref = llama4
    x = ids(VOCAB, 1, 10)
    experts = [layer.mlp.experts for layer in m.net.model.layers if hasattr(layer.mlp, "gate")]
    try:
        for e in experts:
            e.scale_input = False
        m.reset()
        assert rel_err(m.forward(x), ref(x).logits) > 1e-3
    finally:
        for e in experts:
            e.scale_input = True


def write_multimodal(folder, text: dict, released: bool = True):
    """A tiny Llama4ForConditionalGeneration (a one-layer vision model) around `text`, saved
    in the hub's style; returns its text model (the reference). `released`: with the released
    configs' `attn_temperature_tuning: 4`, which transformers 5.24's strict config refuses
    (llama.cpp's converter reads the config through it)."""
    from transformers import Llama4Config as HFConfig
    from transformers import Llama4ForConditionalGeneration

    text = {k: v for k, v in text.items() if k != "model_type"}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14, vision_output_dim=16,
                  projector_input_dim=16, projector_output_dim=16)  # fmt: skip
    torch.manual_seed(0)
    ref = Llama4ForConditionalGeneration(HFConfig(text_config=text, vision_config=vision)).eval()
    randomize(ref)
    ref.save_pretrained(folder)
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["text_config"] = hub_style(cfg["text_config"])
    if released:
        cfg["text_config"]["attn_temperature_tuning"] = 4  # as Scout's config.json spells it
    path.write_text(json.dumps(cfg))
    return ref.language_model


@torch.no_grad()
def test_multimodal_repo_loads_its_text_model(tmp_path):
    """A `llama4` repo: text_config read, language_model.* mapped, the vision model and the
    projector skipped; logits equal the reference's text model's."""
    ref = write_multimodal(tmp_path, SCOUT)
    m = load_model(tmp_path, max_seq_len=64, max_batch_size=1)
    assert m.config.model_type == "llama4"
    check_prefill(m, ref, ids(VOCAB, 1, 12))
    check_decode(m, ref, ids(VOCAB, 1, 12), prefill=5)


def test_bad_configs_are_refused():
    with pytest.raises(ConfigError, match=r"'no_rope_layers' lists 2 layers"):
        Llama4TextConfig.from_dict(dict(SCOUT, no_rope_layers=[1, 0])).to_runtime()
    with pytest.raises(ConfigError, match=r"'moe_layers' names layers \[7\]"):
        Llama4TextConfig.from_dict(dict(SCOUT, moe_layers=[1, 7])).to_runtime()
    kinds = ["chunked_attention"] * 4
    with pytest.raises(ConfigError, match=r"'attention_chunk_size' is not set"):
        Llama4TextConfig.from_dict(
            dict(SCOUT, layer_types=kinds, attention_chunk_size=None)
        ).to_runtime()
    with pytest.raises(ConfigError, match=r"'layer_types' must give one of"):
        Llama4TextConfig.from_dict(dict(SCOUT, layer_types=["sliding_attention"] * 4)).to_runtime()
    with pytest.raises(ConfigError, match=r"text_config"):
        Llama4Config.from_dict({"model_type": "llama4"})


@pytest.mark.parametrize(
    ("name", "experts", "moe"),
    [("llama4-scout", 16, tuple(range(48))), ("llama4-maverick", 128, tuple(range(1, 48, 2)))],
)
def test_registry_shapes_are_scout_and_maverick(name, experts, moe):
    """registry.yaml's shapes build (on the meta device) the released text models: the
    parameter count is the entry's; every 4th layer NoPE and unchunked, the others chunked."""
    from core.hub import named_models
    from core.modeling import CausalLM

    entry = named_models()[name]
    cfg = Llama4Config.from_dict(entry["shape"]).to_runtime()
    assert (cfg.moe.num_experts, cfg.moe.layers, cfg.moe.top_k) == (experts, moe, 1)
    chunks = [a.chunk for a in cfg.attention_layers]
    assert chunks == [None if (i + 1) % 4 == 0 else 8192 for i in range(48)]
    with torch.device("meta"):
        net = CausalLM(cfg)
    assert f"{sum(p.numel() for p in net.parameters()) / 1e9:.1f}B" == entry["params"]


@torch.no_grad()
def test_gguf_file_of_llama_cpps_converter_matches_the_checkpoint(tmp_path):
    """llama.cpp's converter writes a released-style `llama4` repo's text model as a llama4
    file (q/k as the hub's, experts split per kind). It stores no chunk, NoPE or temperature
    settings, so the checkpoint has what llama.cpp implies (chunks of 8192, every 4th layer
    NoPE, floor 8192, scale 0.1, q/k norms with 4 experts); experts on every other layer test
    the dense layers' names too."""
    from fixtures.chat_tokenizers import build_tokenizer_folder
    from fixtures.llama_cpp_convert import convert

    folder = tmp_path / "hf"
    special = build_tokenizer_folder(folder, "qwen2")
    implied = dict(attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1)
    spec = dict(SCOUT, **implied, interleave_moe_layer_step=2, vocab_size=320,
                bos_token_id=None, eos_token_id=special["<|im_end|>"])  # fmt: skip
    write_multimodal(folder, spec, released=False)
    path = convert(folder, tmp_path / "f32.gguf")
    kw = dict(max_seq_len=64, max_batch_size=1, dtype="float32")
    ours, theirs = load_model(path, **kw), load_model(folder, **kw)
    assert ours.config.model_type == "llama4_text"
    # the same layers; llama3 rope fitted back from the file's factors: the same frequencies
    assert ours.config.attention_layers == theirs.config.attention_layers
    assert ours.config.moe == theirs.config.moe and ours.config.mlp == theirs.config.mlp
    x = torch.randint(0, 320, (1, 20), generator=torch.Generator().manual_seed(0))
    assert rel_err(ours.forward(x), theirs.forward(x)) <= 1e-4


def test_gguf_files_llama_cpp_runs_otherwise_are_refused():
    """A llama4 file without experts, or with sliding_window 0 (MobileLLM), is refused."""
    from pathlib import Path

    from plugins.formats.gguf_archs import ARCHITECTURES

    configure = ARCHITECTURES["llama4"].configure
    for meta in ({"attention.sliding_window": 0, "expert_count": 16}, {}):
        with pytest.raises(ConfigError, match=r"MobileLLM\) is not supported"):
            configure(lambda key, default=None, m=meta: m.get(key, default), {}, Path("x.gguf"))
    cfg = configure(lambda key, default=None: {"expert_count": 128}.get(key), {}, Path("x"))
    assert cfg["attention_chunk_size"] == 8192 and cfg["use_qk_norm"] is False
