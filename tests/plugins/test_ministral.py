"""Ministral 3 (`ministral3`) and multimodal Mistral 3 (`mistral3`, its text model) against
transformers on tiny random checkpoints (fp32): YaRN, and the queries' per-position scale
(`llama_4_scaling_beta`) over an original length of 4 positions, so that it grows within the
test prompts; the mistral3 checkpoint's vision tower and projector are skipped at load."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import randomize
from parity import ParitySuite, ids, rel_err

from core import ConfigError, load_model
from core.config import YarnRope
from core.cpu_step import why_not

VOCAB = 128
ROPE = {"rope_type": "yarn", "type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
        "original_max_position_embeddings": 4, "max_position_embeddings": 128,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.5}  # fmt: skip
TEXT = dict(
    model_type="ministral3",
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rope_parameters=ROPE,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
VISION = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2, head_dim=16, image_size=28, patch_size=14)  # fmt: skip


def save(root, multimodal: bool, text: dict = TEXT):
    """A Ministral3ForCausalLM, or a Mistral3ForConditionalGeneration with a tiny vision tower,
    saved as transformers 5 writes it (rope_parameters, the hub's weight names)."""
    from transformers import AutoConfig, AutoModelForCausalLM, Mistral3ForConditionalGeneration

    torch.manual_seed(0)
    if multimodal:
        config = AutoConfig.for_model("mistral3", text_config=text, vision_config=VISION)
        ref = Mistral3ForConditionalGeneration(config).eval()
    else:
        ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(**text)).eval()
    randomize(ref)
    ref.save_pretrained(root)
    return root, ref


@pytest.fixture(scope="module", params=["ministral3", "mistral3"])
def ministral(request, tmp_path_factory):
    root, ref = save(tmp_path_factory.mktemp(request.param), request.param == "mistral3")
    assert json.loads((root / "config.json").read_text())["model_type"] == request.param
    return load_model(root, max_seq_len=64, max_batch_size=2), ref


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on this module's models."""

    vocab = VOCAB

    @pytest.fixture
    def model(self, ministral):
        return ministral


def test_spec_and_fused_step(ministral):
    m, _ = ministral
    spec = m.net.config.layer_attention(0)
    assert spec.query_scale == (0.5, 4) and isinstance(m.net.config.rope, YarnRope)
    # mistral3: tied, as transformers ties where the top level does not say (TEXT says not to)
    assert m.net.config.tie_word_embeddings == (m.net.config.model_type == "mistral3")
    assert "scales queries by position" in why_not(m.net)


@torch.no_grad()
def test_query_scale_matters(ministral):
    """Without the queries' scale the logits move: the parity checks above can fail."""
    m, ref = ministral
    x = ids(VOCAB, 1, 16)
    attns = [layer.self_attn for layer in m.net.model.layers]
    specs = [a.spec for a in attns]
    for a in attns:
        a.spec = replace(a.spec, query_scale=None)
    try:
        m.reset()
        assert rel_err(m.forward(x), ref(x).logits) > 1e-3
    finally:
        for a, s in zip(attns, specs, strict=True):
            a.spec = s


def test_config_defaults_and_errors():
    """transformers' defaults: YaRN with the scale when config.json gives no rope; a mistral3
    ties its head unless the top level says not to; a mistral text model scales no queries."""
    from plugins.ministral import Ministral3Config, Mistral3Config

    bare = {k: v for k, v in TEXT.items() if k != "rope_parameters"}
    cfg = Ministral3Config.from_dict(bare).to_runtime()
    assert isinstance(cfg.rope, YarnRope) and cfg.rope.factor == 16.0
    assert cfg.attention.query_scale == (0.1, 16384)
    multi = {"model_type": "mistral3", "text_config": TEXT}
    assert Mistral3Config.from_dict(multi).to_runtime().tie_word_embeddings
    mistral = dict(TEXT, model_type="mistral", rope_parameters=None, rope_theta=1e6)
    cfg = Mistral3Config.from_dict({**multi, "text_config": mistral}).to_runtime()
    assert cfg.attention.query_scale is None and type(cfg.rope).__name__ == "DefaultRope"
    with pytest.raises(ConfigError, match=r"text_config.model_type.*'llama'"):
        Mistral3Config.from_dict({**multi, "text_config": dict(TEXT, model_type="llama")})
    rope = {k: v for k, v in ROPE.items() if k != "original_max_position_embeddings"}
    rope["rope_type"] = rope["type"] = "default"
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        Ministral3Config.from_dict(dict(TEXT, rope_parameters=rope)).to_runtime()


def test_registry_shape_is_ministral3_8b():
    """registry.yaml's `ministral3` shape: YaRN and the query scale from text_config (its
    parameter count: tests/core/test_registry_shapes.py)."""
    from core.hub import named_models
    from plugins.ministral import Mistral3Config

    entry = named_models()["ministral3"]
    cfg = Mistral3Config.from_dict(entry["shape"]).to_runtime()
    assert cfg.attention.query_scale == (0.1, 16384) and cfg.rope.factor == 16.0


def test_gguf_file_of_llama_cpps_converter_equals_the_checkpoint(tmp_path):
    """llama.cpp writes Ministral 3 as `mistral3` (the scale as attention.temperature_scale,
    q and k permuted): the F32 file of the multimodal checkpoint loads as its text model."""
    from fixtures.chat_tokenizers import build_tokenizer_folder
    from fixtures.llama_cpp_convert import convert

    folder = tmp_path / "hf"
    special = build_tokenizer_folder(folder, "qwen2")
    text = dict(TEXT, vocab_size=320, eos_token_id=special["<|im_end|>"])
    save(folder, True, text)
    path = convert(folder, tmp_path / "f32.gguf")
    kw = dict(max_seq_len=64, max_batch_size=1, dtype="float32")
    ours, theirs = load_model(path, **kw), load_model(folder, **kw)
    assert ours.config.model_type == "ministral3"
    assert ours.config.attention_layers == theirs.config.attention_layers
    x = ids(320, 1, 20)
    assert rel_err(ours.forward(x), theirs.forward(x)) < 1e-4


def test_gguf_mistral3_without_the_scale_is_mistral():
    """A mistral3 file without attention.temperature_scale (Mistral Small 3.1's text model)
    loads as a plain mistral, not as a Ministral 3 with its default YaRN."""
    from pathlib import Path

    from plugins.formats.gguf_archs import ARCHITECTURES

    configure = ARCHITECTURES["mistral3"].configure
    cfg = configure({}.get, {"rope_theta": 1e9}, Path("f.gguf"))
    assert cfg == {"rope_theta": 1e9, "model_type": "mistral"}
