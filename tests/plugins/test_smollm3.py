"""SmolLM3 parity against transformers on tiny random checkpoints (fp32): NoPE layers, every
4th by `no_rope_layer_interval` or as `no_rope_layers` lists them, tied embeddings."""

from __future__ import annotations

import pytest
import torch
from conftest import make_checkpoint
from parity import (
    ParitySuite,
    ids,
    rel_err,
)

from core import ConfigError, load_model

# SmolLM3-3B-style: GQA 4/2, tied, rope_theta from the release, layer 3 NoPE
SMOLLM3 = dict(
    model_type="smollm3",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=5000000.0,
    no_rope_layer_interval=4,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,  # transformers' default (128004) lies outside the tiny vocabulary
)
# the list spelled out, with NoPE on layers 0 and 2 instead
SMOLLM3_LIST = dict(SMOLLM3, no_rope_layers=[0, 1, 0, 1], tie_word_embeddings=False)
VOCAB = SMOLLM3["vocab_size"]
SPECS = {"smollm3-interval": SMOLLM3, "smollm3-list": SMOLLM3_LIST}
NOPE = {"smollm3-interval": [3], "smollm3-list": [0, 2]}


@pytest.fixture(scope="module", params=list(SPECS))
def smollm3(request, tmp_path_factory):
    root, ref = make_checkpoint(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    m = load_model(root, max_seq_len=64, max_batch_size=2)
    nope = [i for i, layer in enumerate(m.net.model.layers) if layer.self_attn.spec.rope == "none"]
    assert nope == NOPE[request.param]
    return m, ref


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on this module's models."""

    vocab = VOCAB

    @pytest.fixture
    def model(self, smollm3):
        return smollm3


def test_nope_layers_matter(smollm3):
    """Rope on every layer gives other logits: the checks above can fail."""
    m, ref = smollm3
    x = ids(VOCAB, 1, 12)
    keep = list(m.net.rope_of_layer)
    m.net.rope_of_layer = [0] * len(keep)
    try:
        m.reset()
        assert rel_err(m.forward(x), ref(x).logits) > 1e-3
    finally:
        m.net.rope_of_layer = keep
    with torch.no_grad():
        m.reset()
        assert rel_err(m.forward(x), ref(x).logits) < 1e-4


def test_short_no_rope_layers_is_refused():
    from plugins.smollm3 import SmolLM3Config

    with pytest.raises(ConfigError, match=r"'no_rope_layers' lists 2 layers.*num_hidden_layers=4"):
        SmolLM3Config.from_dict(dict(SMOLLM3, no_rope_layers=[1, 0])).to_runtime()
    with pytest.raises(ConfigError, match=r"no_rope_layers"):
        SmolLM3Config.from_dict(dict(SMOLLM3, no_rope_layers=[1, 2, 1, 1])).to_runtime()
