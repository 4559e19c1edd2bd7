"""The fused CPU decode step over Mamba2 layers (core/cpu_step.py, kernels/cpu/mamba.c) against
the modules it replaces: a hybrid of three Mamba2 layers and one attention layer (biases, two
groups of B / C, a dt clamp that bites), ragged rows decoded step by step both ways, with fp32
weights and with weights kept in int8 blocks; `zoo info` names the fused step. (The C layer
against transformers' own Mamba2 layer: tests/kernels/test_cpu_mamba.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import LLAMA32, randomize
from fixtures.fused_steps import decode, feed, rel_err

from core.cli.info import _decode_path
from core.config_kinds import Mamba2Spec
from core.cpu_step import why_not
from core.model import Model
from core.modeling import CausalLM
from core.quantize import quantize_model
from kernels.cpu.build import library
from plugins.llama3 import LlamaConfig

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the step is unfused")

SPEC = Mamba2Spec(num_heads=4, head_dim=16, state_size=16, n_groups=2, conv_kernel=4,
                  chunk_size=16, norm_eps=1e-5, conv_bias=True, bias=True,
                  time_step_limit=(0.0, 0.6))  # fmt: skip


def hybrid(quantize: str | None = None) -> Model:
    """Mamba2, Mamba2, attention, Mamba2 (hidden 64: whole groups of 32 for int8), random."""
    cfg = LlamaConfig.from_dict(dict(LLAMA32, hidden_size=64, num_hidden_layers=4)).to_runtime()
    cfg = dataclasses.replace(cfg, attention_layers=(SPEC, SPEC, cfg.attention, SPEC))
    net = CausalLM(cfg)
    randomize(net)
    if quantize:
        quantize_model(net, quantize)
    net.setup_caches(2, 64)
    return Model(net.eval(), None, Path("<random hybrid>"))


@pytest.fixture(scope="module")
def model():
    return hybrid()


def test_the_fused_step_equals_the_modules(model):
    assert why_not(model.net) is None
    assert "3 x Mamba2 + GatedMLP, 1 x GQAAttention + GatedMLP" in _decode_path(model)
    tokens = feed()
    for got, want in zip(decode(model, True, tokens), decode(model, False, tokens), strict=True):
        assert rel_err(got, want) < 1e-5


def test_the_clamp_and_d_reach_the_logits(model):
    """Without the dt clamp or D the modules' logits move: the check above can fail."""
    tokens = feed()[:3]
    want = decode(model, False, tokens)[-1]
    layer = model.net.model.layers[0].self_attn
    spec, d = layer.spec, layer.D.detach().clone()
    layer.spec = dataclasses.replace(spec, time_step_limit=(0.0, float("inf")))
    unclamped = decode(model, False, tokens)[-1]
    layer.spec = spec
    with torch.no_grad():
        layer.D.zero_()
        no_d = decode(model, False, tokens)[-1]
        layer.D.copy_(d)
    assert rel_err(unclamped, want) > 1e-3 and rel_err(no_d, want) > 1e-3


def test_the_fused_step_on_weights_kept_in_int8():
    m = hybrid("int8")
    assert type(m.net.model.layers[0].self_attn.in_proj.weight).__name__ == "BlockWeight"
    tokens = feed(7)
    # the same int8 products either way; the modules round their fp32 steps otherwise, which
    # can move x past one of its 8-bit steps in the next product (as test_cpu_step's int8 bound)
    for got, want in zip(decode(m, True, tokens), decode(m, False, tokens), strict=True):
        assert rel_err(got, want) < 5e-4
