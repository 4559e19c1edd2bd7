"""Mistral parity against transformers on tiny random checkpoints (fp32): v0.1's uniform
sliding window (shorter than the test sequences, on every layer) and v0.3's none."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from conftest import make_checkpoint
from parity import (
    TOL,
    ParitySuite,
    ids,
    rel_err,
)

from core import load_model

# Mistral-7B-v0.3-style: GQA 4/1, untied head, no window
MISTRAL_V03 = dict(
    model_type="mistral",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=1000000.0,
    sliding_window=None,
    bos_token_id=1,
    eos_token_id=2,
)
# v0.1: the same window on every layer (4096 there, 6 here)
MISTRAL_V01 = dict(MISTRAL_V03, rope_theta=10000.0, sliding_window=6)
VOCAB = MISTRAL_V03["vocab_size"]
SPECS = {"mistral-v0.3": MISTRAL_V03, "mistral-v0.1-window": MISTRAL_V01}


@pytest.fixture(scope="module", params=list(SPECS))
def mistral(request, tmp_path_factory):
    root, ref = make_checkpoint(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    m = load_model(root, max_seq_len=64, max_batch_size=2)
    windows = [layer.self_attn.spec.window for layer in m.net.model.layers]
    assert windows == [SPECS[request.param]["sliding_window"]] * 2
    return m, ref


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on this module's models."""

    vocab = VOCAB
    decode = (24, 18)  # a prompt 3x the window, then past
    greedy_len = 18
    ragged: ClassVar[dict] = dict(lengths=(4, 15), steps=3, new=8)

    @pytest.fixture
    def model(self, mistral):
        return mistral


def test_chunked_prefill_longer_than_the_window(mistral):
    """Chunks of 9 and 8 tokens (> window 6) after a first one: each chunk's queries must read
    the keys before it before the chunk overwrites them in the ring."""
    m, ref = mistral
    x = ids(VOCAB, 1, 22)
    m.reset()
    got = [m.forward(x[:, :5], 0), m.forward(x[:, 5:14], 5), m.forward(x[:, 14:], 14)]
    assert rel_err(torch.cat(got, dim=1), ref(x).logits) < TOL


def test_compiled_greedy_past_the_window(tmp_path):
    """The compiled decode step on sliding layers (their ring caches, per-row positions, the
    cache bucket longer than the ring): a ragged batch of two generates past the window, prompts
    2-3x its length, the tokens transformers generates for each row."""
    root, ref = make_checkpoint(tmp_path, MISTRAL_V01)
    m = load_model(root, max_seq_len=64, max_batch_size=2, compile=True)
    m.eos_token_ids = set()
    prompts = [ids(VOCAB, 1, n, seed=n)[0].tolist() for n in (13, 18)]
    got = m.generate(prompts, max_new_tokens=10, ignore_eos=True)
    assert m.step.compiled is not None
    for prompt, res in zip(prompts, got, strict=True):
        kw = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        want = ref.generate(torch.tensor([prompt]), **kw)
        assert res.token_ids == want[0, len(prompt) :].tolist()
