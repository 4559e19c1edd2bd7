"""The Gemma family against transformers on tiny random checkpoints (fp32): Gemma (v1, GQA tied
and MHA untied), Gemma 2 (alternating window / global layers with a window shorter than the test
sequences, attention and final soft-caps small enough to bite, query_pre_attn_scalar, sandwich
norms) and Gemma 3's text model (5:1 window / global as a 2:1 pattern here, a local rope base
beside a linearly scaled global theta, q/k norms), in the hub's key style and in transformers
5's (per-kind rope_parameters, layer_types)."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch
from conftest import make_checkpoint
from parity import (
    ParitySuite,
    ids,
)

from core import ConfigError, RequestError, load_model
from core.catalog import named_models
from core.config import DefaultRope, LinearRope
from core.plugins import registry
from core.tokenizer import Tokenizer

BASE = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
# gemma-2b's shape in miniature: one kv head, head_dim (16) != hidden / heads (12), tied head
GEMMA = dict(BASE, model_type="gemma", hidden_act="gelu_pytorch_tanh", rope_theta=10000.0)
GEMMA_MHA = dict(GEMMA, num_key_value_heads=4, tie_word_embeddings=False)
# Gemma 2: layers 0, 2 windowed (window 5), 1, 3 global; caps of 2 (scores) and 3 (logits),
# well inside the ranges the scaled-up weights produce; scale 1/sqrt(24), not 1/sqrt(16)
GEMMA2 = dict(
    BASE,
    model_type="gemma2",
    num_hidden_layers=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    sliding_window=5,
    query_pre_attn_scalar=24,
    attn_logit_softcapping=2.0,
    final_logit_softcapping=3.0,
)
# Gemma 3 text: pattern 3 (layers 0, 1, 3, 4 windowed, 2, 5 global), local base 100 beside a
# global theta of 10000 stretched 4x (linear), q/k norms, no soft-caps (as the releases)
GEMMA3 = dict(
    BASE,
    model_type="gemma3_text",
    num_hidden_layers=6,
    num_key_value_heads=2,
    sliding_window=5,
    sliding_window_pattern=3,
    query_pre_attn_scalar=24,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
)
VOCAB = BASE["vocab_size"]


def hub_keys(cfg: dict, spec: dict) -> dict:
    """config.json as the released Gemma repos spell it (transformers 4): rope_theta,
    rope_scaling, rope_local_base_freq and sliding_window_pattern instead of layer_types."""
    params = cfg.pop("rope_parameters")
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    if "full_attention" not in params:
        return dict(cfg, rope_theta=params["rope_theta"], rope_scaling=None, hidden_act="gelu")
    full, local = params["full_attention"], params["sliding_attention"]
    cfg.pop("layer_types")
    scaling = {"rope_type": full["rope_type"], "factor": full["factor"]}
    return dict(
        cfg,
        rope_theta=full["rope_theta"],
        rope_scaling=scaling,
        rope_local_base_freq=local["rope_theta"],
        sliding_window_pattern=spec["sliding_window_pattern"],
    )


def gemma_checkpoint(root, spec: dict, hub: bool = True):
    root, ref = make_checkpoint(root, spec, raw=True)
    cfg = json.loads((root / "config.json").read_text())
    if hub:
        cfg = hub_keys(cfg, spec)
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    return root, ref


CASES = {
    "gemma": (GEMMA, True),
    "gemma-mha": (GEMMA_MHA, True),
    "gemma2": (GEMMA2, True),
    "gemma3": (GEMMA3, True),
    "gemma3-transformers5-keys": (GEMMA3, False),
}


@pytest.fixture(scope="module", params=list(CASES))
def gemma(request, tmp_path_factory):
    spec, hub = CASES[request.param]
    root, ref = gemma_checkpoint(tmp_path_factory.mktemp(request.param), spec, hub)
    m = load_model(root, max_seq_len=64, max_batch_size=2)
    return m, ref, request.param


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on this module's models."""

    vocab = VOCAB
    prefill_len = 20  # 4x the window
    decode = (24, 13)  # decode well past the window
    greedy_len = 9  # generation past the window
    ragged: ClassVar[dict] = dict(lengths=(4, 11), steps=3, new=6)

    @pytest.fixture
    def model(self, gemma):
        return gemma


def test_layer_specs_read_as_transformers(gemma):
    m, ref, name = gemma
    layers = [layer.self_attn.spec for layer in m.net.model.layers]
    kinds = getattr(ref.config, "layer_types", None) or ["full_attention"] * len(layers)
    assert [s.window for s in layers] == [5 if k == "sliding_attention" else None for k in kinds]
    if name.startswith("gemma2"):
        assert {s.softcap for s in layers} == {2.0} and m.config.final_softcap == 3.0
        assert layers[0].scale == 24**-0.5
    if name.startswith("gemma3"):
        assert [s.window for s in layers] == [5, 5, None, 5, 5, None]
        ropes = [m.config.layer_rope(i) for i in range(6)]
        assert ropes[0] == DefaultRope(theta=100.0, dim=16)
        assert ropes[2] == LinearRope(theta=10000.0, dim=16, factor=4.0)
        assert layers[0].qk_norm is not None and m.config.final_softcap is None


def to_runtime(raw: dict):
    return registry().architecture(raw["model_type"]).config.from_dict(raw).to_runtime()


def test_official_configs_load():
    for name, n, windows in (("gemma2-2b", 26, {4096, None}), ("gemma3-1b", 26, {512, None})):
        cfg = to_runtime(named_models()[name]["shape"])
        assert cfg.num_layers == n and {a.window for a in cfg.attention_layers} == windows
    g3 = to_runtime(named_models()["gemma3-270m"]["shape"])
    assert [a.window is None for a in g3.attention_layers] == [(i + 1) % 6 == 0 for i in range(18)]


def test_bad_configs_name_the_field():
    raw = dict(GEMMA2, torch_dtype="float32")
    raw.pop("hidden_size")
    with pytest.raises(ConfigError, match="hidden_size"):
        to_runtime(raw)
    with pytest.raises(ConfigError, match="hidden_activation"):
        to_runtime(dict(GEMMA2, hidden_activation="relu"))
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        to_runtime(dict(GEMMA2, attn_logit_softcapping=-1.0))
    with pytest.raises(ConfigError, match="layer_types"):
        to_runtime(dict(GEMMA3, layer_types=["chunked_attention"] * 6))
    bad = {"sliding_attention": {"rope_type": "yarn", "rope_theta": 10.0}}
    with pytest.raises(ConfigError, match=r"sliding_attention\.rope_type"):
        to_runtime(dict(GEMMA3, rope_parameters=bad))


@torch.no_grad()
def test_final_softcap_bites(tmp_path):
    """The cap of 3 bounds the logits; without it they reach past it (so the test can fail)."""
    root, _ = gemma_checkpoint(tmp_path, GEMMA2)
    m = load_model(root, max_seq_len=32)
    x = ids(VOCAB, 1, 12)
    got = m.forward(x)
    assert got.abs().max() < 3.0
    m.net.config = m.config = type(m.config)(**{**m.config.__dict__, "final_softcap": None})
    m.reset()
    assert m.forward(x).abs().max() > 3.0


# google/gemma-2-2b-it's chat template (Gemma 1 and 2 ship it): no system role, "model" turns
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
    "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user')"
    " != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ "
    "'<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)


def test_chat_template_renders_in_the_sandbox(tmp_path):
    """Gemma's template through Zoo's sandboxed renderer equals transformers' rendering; a
    system message is the template's own error, as a RequestError."""
    from fixtures.chat_tokenizers import build_tokenizer_folder
    from transformers import AutoTokenizer

    build_tokenizer_folder(tmp_path, "llama3")
    ours, hf = Tokenizer.from_folder(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    ours.chat_template = GEMMA_TEMPLATE
    chat = [
        {"role": "user", "content": "  Why is the sky blue?\n"},
        {"role": "assistant", "content": "Rayleigh scattering."},
        {"role": "user", "content": "And sunsets?"},
    ]
    want = hf.apply_chat_template(
        chat, chat_template=GEMMA_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert ours.render_chat(chat) == want
    assert want.endswith("<start_of_turn>user\nAnd sunsets?<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(RequestError, match="System role not supported"):
        ours.render_chat([{"role": "system", "content": "Be terse."}, *chat])
