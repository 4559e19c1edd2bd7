"""The Mamba2 layer (core/layers/mamba2.py) on its own: equal to transformers'
GraniteMoeHybridMambaLayer (fp32, several chunks, n_groups 2, conv bias, dt clamped); a prompt
prefilled in chunks of 1, 7 and 64 tokens leaves the same conv and SSM state (and outputs) as
one pass; right padding never reaches a row's state; tensor parallelism refuses the kind."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import LLAMA32

from core import ConfigError
from core.config import GQASpec
from core.config_kinds import Mamba2Spec, ParallelMixerSpec
from core.layers.mamba2 import Mamba2
from core.parallel import tp as tp_mod
from plugins.llama3 import LlamaConfig

HIDDEN, T = 32, 70
SPEC = Mamba2Spec(num_heads=4, head_dim=16, state_size=8, n_groups=2, conv_kernel=4,
                  chunk_size=16, norm_eps=1e-5, time_step_limit=(0.0, 1.5))  # fmt: skip


@pytest.fixture(scope="module")
def layers():
    """(ours, transformers') with the same random weights, scaled so every part shows."""
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf

    cfg = GraniteMoeHybridConfig(
        hidden_size=HIDDEN, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, rms_norm_eps=1e-5,
        time_step_limit=(0.0, 1.5), layer_types=["mamba"], num_hidden_layers=1,
    )  # fmt: skip
    theirs = hf.GraniteMoeHybridMambaLayer(cfg, 0).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() > 1 else 1.0))
    ours = Mamba2(HIDDEN, SPEC)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours, theirs


def states(b: int = 1):
    lay = SPEC.cache_layout(b, 0)
    return torch.randn(lay["conv"]), torch.randn(lay["ssm"])  # garbage: position 0 resets


def x_of(b: int, t: int = T, seed: int = 1):
    return torch.randn(b, t, HIDDEN, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_equals_transformers_and_the_clamp_matters(layers):
    ours, theirs = layers
    x = x_of(2)
    want = theirs(x)
    got = ours(x, None, None, *states(2), 0, T)
    assert (got - want).abs().max() / want.abs().max() < 1e-5
    # the dt limit is reached: without it the outputs move
    loose = Mamba2(HIDDEN, dataclasses.replace(SPEC, time_step_limit=(0.0, float("inf"))))
    loose.load_state_dict(ours.state_dict())
    assert (loose(x, None, None, *states(2), 0, T) - want).abs().max() > 1e-2


@torch.no_grad()
@pytest.mark.parametrize("step", [1, 7, 64])
def test_chunked_prefill_gives_the_state_of_one_pass(layers, step):
    ours, _ = layers
    x = x_of(1)
    whole = states()
    want = ours(x, None, None, *whole, 0, T)
    part = states()
    got = torch.cat([ours(x[:, i : i + step], None, None, *part, i, min(i + step, T))
                     for i in range(0, T, step)], dim=1)  # fmt: skip
    for a, b in zip(part, whole, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_padding_never_reaches_a_rows_state(layers):
    ours, _ = layers
    x = x_of(2)
    lengths = torch.tensor([T, 23])
    batch = states(2)
    got = ours(x, None, None, *batch, 0, T, lengths)
    alone = states()
    want = ours(x[1:, :23], None, None, *alone, 0, 23)
    assert torch.allclose(got[1, :23], want[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(batch, alone, strict=True):
        assert torch.allclose(a[1], b[0], rtol=1e-5, atol=1e-5)


def test_tensor_parallelism_refuses_mamba2_by_name():
    cfg = LlamaConfig.from_dict(LLAMA32).to_runtime()
    hybrid = dataclasses.replace(cfg, attention_layers=(cfg.attention, SPEC))
    with pytest.raises(ConfigError, match=r"layer 1's Mamba2Spec is not a kind .* tp=1"):
        tp_mod.check(hybrid, 2, "config.json")


def test_a_parallel_layer_refuses_a_sliding_attention():
    """Falcon-H1's parallel layer beside a sliding attention: refused, since the cache would
    take the ring (no position dim, no window on the layer's spec) for a recurrent state,
    snapshot it and offer its wrapped positions as a prefix."""
    full = GQASpec(num_heads=2, num_kv_heads=1, head_dim=16)
    assert ParallelMixerSpec(attention=full, mamba=SPEC).attention is full
    with pytest.raises(ValueError, match="sliding window"):
        ParallelMixerSpec(attention=dataclasses.replace(full, window=8), mamba=SPEC)
