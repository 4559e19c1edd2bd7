"""Llama 3.x parity against transformers on tiny random checkpoints (fp32)."""

from __future__ import annotations

import pytest
import torch
from conftest import LLAMA31, LLAMA32
from parity import check_ragged_batch

from core import load_model

VOCAB = LLAMA32["vocab_size"]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def ids(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": LLAMA32["rope_scaling"],
}


@pytest.mark.parametrize("spec", [LLAMA32, LLAMA31], ids=["llama3.2-tied", "llama3.1-untied"])
def test_prefill_logits_match(checkpoint, spec):
    root, ref = checkpoint(spec)
    m = load_model(root, max_batch_size=2)
    x = ids(2, 21)
    assert rel_err(m.forward(x), ref(x).logits) < 1e-4


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_kinds_match(checkpoint, kind):
    # 40 tokens > max_position_embeddings (32): dynamic NTK scaling kicks in mid-sequence.
    spec = dict(LLAMA31, rope_scaling=ROPES[kind], max_position_embeddings=32)
    if kind == "llama3":
        spec["rope_scaling"] = dict(ROPES[kind], original_max_position_embeddings=8)
    root, ref = checkpoint(spec)
    m = load_model(root, max_seq_len=48)
    x = ids(1, 40)
    assert rel_err(m.forward(x), ref(x).logits) < 1e-4


@pytest.mark.parametrize("rope_key", ["type", "rope_type"])
def test_rope_scaling_key_spellings(checkpoint, rope_key):
    root, ref = checkpoint(LLAMA32, rope_key=rope_key)
    x = ids(1, 12)
    assert rel_err(load_model(root).forward(x), ref(x).logits) < 1e-4


def test_transformers5_rope_parameters_layout(checkpoint):
    root, ref = checkpoint(LLAMA32, raw=True)  # as saved by transformers 5: rope_parameters
    assert "rope_parameters" in (root / "config.json").read_text()
    x = ids(1, 12)
    assert rel_err(load_model(root).forward(x), ref(x).logits) < 1e-4


@pytest.mark.parametrize("spec", [LLAMA32, LLAMA31], ids=["tied", "untied"])
def test_decode_steps_match_full_sequence(checkpoint, spec):
    root, ref = checkpoint(spec)
    m = load_model(root)
    x = ids(1, 16)
    want = ref(x).logits
    got = [m.forward(x[:, :10], 0)]
    for t in range(10, 16):  # one token at a time through the KV cache
        got.append(m.forward(x[:, t : t + 1], t))
    assert rel_err(torch.cat(got, dim=1), want) < 1e-4


@pytest.mark.parametrize("spec", [LLAMA32, LLAMA31], ids=["tied", "untied"])
def test_greedy_tokens_identical(checkpoint, spec):
    root, ref = checkpoint(spec)
    prompt = ids(1, 7, seed=3)
    want = ref.generate(
        prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, 7:].tolist()
    m = load_model(root)
    # transformers was told not to stop; make ours not stop either, so 12 tokens are compared
    m.eos_token_ids = set()
    got = m.generate(prompt[0].tolist(), max_new_tokens=12)
    assert got.token_ids == want
    assert len(got.token_ids) == 12 and got.finish_reason == "length"


def test_greedy_stops_at_eos_like_transformers(checkpoint):
    root, ref = checkpoint(LLAMA32)
    prompt = ids(1, 7, seed=3)
    first = ref(prompt).logits[0, -1].argmax().item()
    m = load_model(root)
    m.eos_token_ids = {first}  # the first greedy token is an eos
    out = m.generate(prompt[0].tolist(), max_new_tokens=12)
    assert out.token_ids == [first] and out.finish_reason == "stop"


def test_batch_of_two_equals_each_alone(checkpoint):
    root, ref = checkpoint(LLAMA32)
    m = load_model(root, max_batch_size=2)
    x = ids(2, 13)
    both = m.forward(x)
    for row in range(2):
        m.reset()
        alone = m.forward(x[row : row + 1])
        assert rel_err(both[row : row + 1], alone) < 1e-5
        assert rel_err(alone, ref(x[row : row + 1]).logits) < 1e-4  # and both are transformers'
    # decode continues per row through the cache
    m.reset()
    m.forward(x[:, :12])
    step = m.forward(x[:, 12:13], 12)
    assert rel_err(step, both[:, 12:13]) < 1e-4


@pytest.mark.parametrize("spec", [LLAMA32, LLAMA31], ids=["tied", "untied"])
def test_ragged_batch_at_per_row_positions(checkpoint, spec):
    root, ref = checkpoint(spec)
    check_ragged_batch(load_model(root, max_batch_size=2), ref, VOCAB)


def test_bf16_close_to_fp32_reference(checkpoint):
    root, ref = checkpoint(LLAMA32)
    x = ids(1, 12)
    got = load_model(root, dtype="bfloat16").forward(x)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, ref(x).logits) < 5e-2  # bf16 keeps ~3 significant digits
