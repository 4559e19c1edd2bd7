"""Qwen3 parity against transformers on tiny random checkpoints (fp32): per-head q/k RMSNorm,
an explicit head_dim (not hidden / heads), and sliding windows shorter than the test
sequences on the layers from max_window_layers on."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from conftest import make_checkpoint
from parity import (
    ParitySuite,
    ids,
    rel_err,
)

from core import load_model
from core.config import RMSNormSpec

# Qwen3-0.6B-style: head_dim 24 > hidden / heads = 16, tied embeddings, no biases
QWEN3 = dict(
    model_type="qwen3",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    use_sliding_window=False,
    sliding_window=None,
    max_window_layers=3,
    bos_token_id=1,
    eos_token_id=2,
)
# the sliding-window keys switched on: layers 1 and 2 attend within 5 tokens
QWEN3_SLIDING = dict(
    QWEN3, tie_word_embeddings=False, use_sliding_window=True, sliding_window=5, max_window_layers=1
)
VOCAB = QWEN3["vocab_size"]
SPECS = {"qwen3": QWEN3, "qwen3-sliding": QWEN3_SLIDING}


@pytest.fixture(scope="module", params=list(SPECS))
def qwen3(request, tmp_path_factory):
    """(loaded model, transformers reference) per spec, built once per module."""
    root, ref = make_checkpoint(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    return load_model(root, max_seq_len=64, max_batch_size=2), ref


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on this module's models."""

    vocab = VOCAB
    prefill_len = 23  # 23 > 4x the window
    decode = (20, 13)  # decode past the window
    greedy_len = 15  # a prompt 3x the window
    ragged: ClassVar[dict] = dict(lengths=(4, 16), steps=3, new=8)

    @pytest.fixture
    def model(self, qwen3):
        return qwen3


def test_config_reads_qk_norm_head_dim_and_windows():
    from plugins.qwen3 import Qwen3Config

    cfg = Qwen3Config.from_dict(QWEN3_SLIDING).to_runtime()
    specs = [cfg.layer_attention(i) for i in range(3)]
    assert [s.window for s in specs] == [None, 5, 5]
    assert all(s.qk_norm == RMSNormSpec(1e-6) and s.head_dim == 24 for s in specs)
    assert not specs[0].qkv_bias and not specs[0].o_bias
    # the cache: full layers keep every position, sliding ones their window
    per_layer = 2 * 2 * 24 * 4  # k and v, 2 kv heads, head_dim 24, fp32
    assert cfg.kv_bytes_per_token(4) == per_layer
    assert cfg.kv_bytes(4, 64) == per_layer * (64 + 5 + 5)
    # absent head_dim: transformers' default, 128
    no_head_dim = {k: v for k, v in QWEN3.items() if k != "head_dim"}
    assert Qwen3Config.from_dict(no_head_dim).to_runtime().attention.head_dim == 128


def test_qk_norm_is_loaded_and_matters(qwen3):
    m, ref = qwen3
    attn = m.net.model.layers[0].self_attn
    want = ref.model.layers[0].self_attn.q_norm.weight
    assert torch.equal(attn.q_norm.weight, want)
    x = ids(VOCAB, 1, 9)
    with torch.no_grad():
        attn.q_norm.weight.fill_(1.0)
        try:
            m.reset()
            assert rel_err(m.forward(x), ref(x).logits) > 1e-3  # the parity checks can fail
        finally:
            attn.q_norm.weight.copy_(want)


def test_sliding_cache_is_a_ring_of_the_window(qwen3):
    m, _ = qwen3
    shapes = [bufs[0].shape for bufs in m.net.kv_cache.layers]
    windows = [layer.self_attn.spec.window for layer in m.net.model.layers]
    assert shapes == [(2, 2, 64 if w is None else w, 24) for w in windows]
