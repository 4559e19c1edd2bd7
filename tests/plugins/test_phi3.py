"""Phi-3 parity against transformers on tiny random checkpoints (fp32): Phi-3-mini-4k's window
on every layer (shorter than the test sequences), and Phi-4-mini's LongRoPE (short and long
factors, an original length the test sequences cross) with rope on 3/4 of each head."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import make_checkpoint
from parity import (
    TOL,
    check_batch_of_two,
    check_decode,
    check_greedy,
    check_prefill,
    check_ragged_batch,
    ids,
    rel_err,
)

from core import ConfigError, load_model
from core.catalog import named_models
from core.config import LongRope
from core.plugins import registry

# Phi-3-mini-4k-style: multi-head attention, untied head, default rope, a window on every
# layer (2047 there, 6 here)
PHI3_MINI = dict(
    model_type="phi3",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    original_max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    sliding_window=6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Phi-4-mini-style: GQA 4/2, tied, rope on 12 of 16 dims (6 frequencies), LongRoPE pretrained
# on 16 positions and stretched to 64 (attention factor sqrt(1 + ln 4 / ln 16)), a window that
# never slides (the release: 262144 for 131072 positions)
ROT = 6
PHI4_MINI = dict(
    PHI3_MINI,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    partial_rotary_factor=0.75,
    original_max_position_embeddings=16,
    sliding_window=128,
    rope_scaling=dict(
        type="longrope",
        short_factor=[1.0 + 0.1 * i for i in range(ROT)],
        long_factor=[2.0 + 3.0 * i for i in range(ROT)],
    ),
)
VOCAB = PHI3_MINI["vocab_size"]
SPECS = {"phi3-mini-window": PHI3_MINI, "phi4-mini-longrope": PHI4_MINI}


def phi3_checkpoint(root, spec: dict):
    """A transformers Phi-3 saved with config.json as the hub's Phi-3 repos spell it:
    partial_rotary_factor and original_max_position_embeddings at the top level, rope_scaling
    {type, short_factor, long_factor} or null."""
    root, ref = make_checkpoint(root, spec, raw=True)
    cfg = json.loads((root / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg.update(
        rope_theta=params["rope_theta"],
        partial_rotary_factor=params.get("partial_rotary_factor", 1.0),
        original_max_position_embeddings=spec["original_max_position_embeddings"],
        torch_dtype=cfg.pop("dtype", "float32"),
        rope_scaling=None,
    )
    if params["rope_type"] == "longrope":
        factors = ("short_factor", "long_factor")
        cfg["rope_scaling"] = {"type": "longrope", **{k: params[k] for k in factors}}
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    return root, ref


# the tests that only the LongRoPE model has a crossing for: run on that case alone
LONGROPE_ONLY = pytest.mark.parametrize("phi3", ["phi4-mini-longrope"], indirect=True)


@pytest.fixture(scope="module", params=list(SPECS))
def phi3(request, tmp_path_factory):
    root, ref = phi3_checkpoint(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    m = load_model(root, max_seq_len=64, max_batch_size=2)
    windows = [layer.self_attn.spec.window for layer in m.net.model.layers]
    assert windows == [6, 6] if request.param == "phi3-mini-window" else [None, None]
    return m, ref, request.param


def test_prefill_logits_match(phi3):
    m, ref, _ = phi3
    check_prefill(m, ref, ids(VOCAB, 2, 20))  # longrope: 20 > 16, the long factors
    check_prefill(m, ref, ids(VOCAB, 2, 12))  # longrope: the short factors


def test_decode_steps_match_full_sequence(phi3):
    m, ref, _ = phi3
    # a prompt 3x the window, then past it; longrope: long factors from the prompt on, as
    # transformers uses for the whole sequence
    check_decode(m, ref, ids(VOCAB, 1, 24), prefill=18)


def test_greedy_tokens_identical(phi3):
    m, ref, _ = phi3
    check_greedy(m, ref, ids(VOCAB, 1, 18, seed=3))  # 3x the window; longrope: long factors
    check_greedy(m, ref, ids(VOCAB, 1, 3, seed=4), n=12)  # longrope: within 16, short


@LONGROPE_ONLY
@torch.no_grad()
def test_longrope_greedy_across_the_original_length(phi3):
    """A prompt of 10, then 12 greedy tokens crossing position 16: Zoo's tokens are those of
    transformers' model run step by step with its cache (each step's q and k take the long
    factors once its position passes 16; earlier keys keep the short ones). transformers'
    `generate` differs: Phi3ForCausalLM.prepare_inputs_for_generation drops the cache at the
    crossing and re-encodes the whole sequence with the long factors, which Zoo does not do."""
    m, ref, _ = phi3
    prompt = ids(VOCAB, 1, 10, seed=3)
    out = ref(prompt, use_cache=True)
    want, cache = [], out.past_key_values
    for _ in range(12):
        want.append(int(out.logits[0, -1].argmax()))
        out = ref(torch.tensor([[want[-1]]]), past_key_values=cache, use_cache=True)
    m.reset()
    m.eos_token_ids = set()
    assert m.generate(prompt[0].tolist(), max_new_tokens=12).token_ids == want


def test_batch_of_two_equals_each_alone(phi3):
    m, ref, _ = phi3
    check_batch_of_two(m, ids(VOCAB, 2, 13), ref)


def test_ragged_batch_at_per_row_positions(phi3):
    m, ref, _ = phi3
    # longrope: the short row stays within 16 positions, the long one is past it from its
    # prompt on, in one right-padded prefill of 18 (the row's own length picks its factors)
    check_ragged_batch(m, ref, VOCAB, lengths=(4, 18), steps=3, new=8)


@LONGROPE_ONLY
@torch.no_grad()
def test_longrope_decode_crosses_the_original_length(phi3):
    """Prefill 10 tokens, then one at a time to 24: each step equals transformers' step with its
    cache (the factor set switches at position 16 for the new token's q and k only)."""
    m, ref, _ = phi3
    x = ids(VOCAB, 1, 24, seed=5)
    out = ref(x[:, :10], use_cache=True)
    want, cache = [out.logits], out.past_key_values
    for t in range(10, 24):
        out = ref(x[:, t : t + 1], past_key_values=cache, use_cache=True)
        want.append(out.logits)
    m.reset()
    got = [m.forward(x[:, :10], 0)] + [m.forward(x[:, t : t + 1], t) for t in range(10, 24)]
    assert rel_err(torch.cat(got, dim=1), torch.cat(want, dim=1)) < TOL
    # the same steps through per-row (tensor) positions, as the token loop feeds them
    m.reset()
    got = [m.forward(x[:, :10], 0)]
    got += [m.forward(x[:, t : t + 1], torch.tensor([t])) for t in range(10, 24)]
    assert rel_err(torch.cat(got, dim=1), torch.cat(want, dim=1)) < TOL


def test_longrope_spec_read_as_transformers(tmp_path):
    root, ref = phi3_checkpoint(tmp_path, PHI4_MINI)
    m = load_model(root, max_seq_len=64)
    rope = m.config.rope
    assert isinstance(rope, LongRope) and rope.dim == 2 * ROT
    assert rope.original_max_position_embeddings == 16
    assert rope.attention_factor == math.sqrt(1 + math.log(64 / 16) / math.log(16))
    assert rope.attention_factor == ref.model.rotary_emb.attention_scaling


def official(name: str, **extra) -> dict:
    """The registry's shape block of `name` (the published config.json's values) + extra."""
    return {**named_models()[name]["shape"], **extra}


def to_runtime(raw: dict):
    return registry().architecture("phi3").config.from_dict(raw).to_runtime()


def test_official_configs_load():
    mini = to_runtime(official("phi3"))
    assert {a.window for a in mini.attention_layers} == {2047}
    assert mini.rope.dim == 96 and type(mini.rope).__name__ == "DefaultRope"
    longrope = dict(type="longrope", short_factor=[1.0] * 48, long_factor=[1.5] * 48)
    for name, dim in (("phi3.5", 96), ("phi4-mini", 96)):
        cfg = to_runtime(official(name, rope_scaling=longrope))
        assert {a.window for a in cfg.attention_layers} == {None}  # 262144 >= 131072
        assert isinstance(cfg.rope, LongRope) and cfg.rope.dim == dim
        assert cfg.rope.original_max_position_embeddings == 4096
        assert cfg.rope.attention_factor == math.sqrt(1 + math.log(32) / math.log(4096))
    assert to_runtime(official("phi4-mini", rope_scaling=longrope)).attention.num_kv_heads == 8
    # early Phi-3 configs named longrope "su"
    su = to_runtime(official("phi3.5", rope_scaling=dict(longrope, type="su")))
    assert isinstance(su.rope, LongRope)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, ["'rope_scaling.type'", "linear"]),
        ({"rope_scaling": {"type": "longrope", "long_factor": [1.0] * ROT}}, ["short_factor"]),
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 5, "long_factor": [1.0]}},
            ["short_factor", "5 values", "needs 6"],
        ),
        ({"partial_rotary_factor": 0.1}, ["partial_rotary_factor", "even"]),
        ({"hidden_size": None}, ["hidden_size"]),
    ],
    ids=["rope-kind", "missing-factor", "factor-length", "rotary-dims", "missing-key"],
)
def test_bad_configs_name_the_field(tmp_path, change, words):
    root, _ = phi3_checkpoint(tmp_path, PHI4_MINI)
    cfg = json.loads((root / "config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **change}.items() if v is not None}
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        load_model(root, device="cpu")
    assert all(w in str(err.value) for w in words), str(err.value)
