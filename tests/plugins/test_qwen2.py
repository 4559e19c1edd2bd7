"""Qwen2 / Qwen2.5 parity against transformers on tiny random checkpoints (fp32)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import make_checkpoint
from parity import (
    ParitySuite,
    check_decode,
    check_greedy,
    check_prefill,
    check_ragged_batch,
    ids,
    rel_err,
)

from core import ConfigError, load_model
from core.config import YarnRope

# Qwen2.5-0.5B-style: GQA 4/2 heads, q/k/v biases, tied embeddings, high rope_theta, and the
# sliding-window keys as the hub ships them (present, but disabled).
QWEN25 = dict(
    model_type="qwen2",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    use_sliding_window=False,
    sliding_window=64,
    max_window_layers=1,
    bos_token_id=1,
    eos_token_id=2,
)
# Qwen2.5-7B-style long context: untied head, YaRN rope (Qwen's README recipe).
QWEN25_YARN = dict(
    QWEN25,
    tie_word_embeddings=False,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32),
)
VOCAB = QWEN25["vocab_size"]
SPECS = {"qwen2.5-tied": QWEN25, "qwen2.5-yarn": QWEN25_YARN}


def hub_config(root, **changes) -> None:
    """Write config.json as Qwen's hub repos do: no `layer_types`, sliding_window kept."""
    path = root / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("layer_types", None)
    cfg["sliding_window"] = QWEN25["sliding_window"]
    path.write_text(json.dumps({**cfg, **changes}))


@pytest.fixture(scope="module", params=list(SPECS))
def qwen(request, tmp_path_factory):
    """(loaded model, transformers reference) per spec, built once per module."""
    root, ref = make_checkpoint(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    hub_config(root)
    return load_model(root, max_seq_len=64, max_batch_size=2), ref


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on this module's models."""

    vocab = VOCAB
    prefill_len = 40  # 40 > original_max_position_embeddings of yarn

    @pytest.fixture
    def model(self, qwen):
        return qwen


def test_biases_are_loaded_and_matter(qwen):
    m, ref = qwen
    attn = m.net.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    ref_attn = ref.model.layers[0].self_attn
    want = torch.cat([ref_attn.get_submodule(p).bias for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(attn.qkv_proj.bias, want)
    x = ids(VOCAB, 1, 9)
    with torch.no_grad():
        attn.qkv_proj.bias.zero_()
        try:
            m.reset()
            assert rel_err(m.forward(x), ref(x).logits) > 1e-3  # the check above can fail
        finally:
            attn.qkv_proj.bias.copy_(want)


def test_tied_and_yarn_configs_read():
    from plugins.qwen2 import Qwen2Config

    tied = Qwen2Config.from_dict(QWEN25).to_runtime()
    assert tied.tie_word_embeddings and tied.attention.qkv_bias and not tied.attention.o_bias
    yarn = Qwen2Config.from_dict(QWEN25_YARN).to_runtime()
    assert isinstance(yarn.rope, YarnRope) and not yarn.rope.interleaved
    assert yarn.rope.attention_factor == 0.1 * math.log(4.0) + 1.0


def test_sliding_window_keys_pick_the_sliding_layers():
    from plugins.qwen2 import Qwen2Config

    def windows(**changes):
        cfg = Qwen2Config.from_dict(dict(QWEN25, **changes)).to_runtime()
        return [cfg.layer_attention(i).window for i in range(cfg.num_layers)]

    assert windows() == [None, None]  # the released configs: a window, but switched off
    assert windows(use_sliding_window=True) == [None, 64]  # layers >= max_window_layers
    # transformers 5's explicit layer_types decide which layers slide
    types = ["sliding_attention", "full_attention"]
    assert windows(use_sliding_window=True, layer_types=types) == [64, None]
    assert windows(use_sliding_window=False, layer_types=types) == [None, None]
    with pytest.raises(ConfigError, match=r"'layer_types' holds 'linear_attention'"):
        windows(use_sliding_window=True, layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ConfigError, match=r"layers \[0\] are sliding_attention.*'sliding_window'"):
        windows(use_sliding_window=True, layer_types=types, sliding_window=None)


def test_sliding_window_enabled_on_no_layer_loads(tmp_path):
    # max_window_layers >= num_hidden_layers: no layer slides, in transformers as here
    spec = dict(QWEN25, use_sliding_window=True, max_window_layers=2)
    root, ref = make_checkpoint(tmp_path, spec)
    hub_config(root, use_sliding_window=True)
    check_prefill(load_model(root, max_seq_len=64), ref, ids(VOCAB, 1, 12))


def test_sliding_window_matches_transformers(tmp_path):
    # use_sliding_window true: layer 1 attends within 6 tokens, shorter than every check's
    spec = dict(QWEN25, use_sliding_window=True, sliding_window=6)
    root, ref = make_checkpoint(tmp_path, spec)
    hub_config(root, use_sliding_window=True, sliding_window=6)
    m = load_model(root, max_seq_len=64, max_batch_size=2)
    assert [layer.self_attn.spec.window for layer in m.net.model.layers] == [None, 6]
    check_prefill(m, ref, ids(VOCAB, 2, 20))
    check_decode(m, ref, ids(VOCAB, 1, 24), prefill=18)  # a prompt 3x the window
    check_greedy(m, ref, ids(VOCAB, 1, 18, seed=3))
    check_ragged_batch(m, ref, VOCAB, lengths=(3, 14), steps=3, new=8)
