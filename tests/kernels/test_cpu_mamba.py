"""The fused CPU step's Mamba2 layer (kernels/cpu/mamba.c through `kernels.cpu.decode.Blocks`)
against transformers' own GraniteMoeHybridMambaLayer: two rows decoded one token at a time at
their own positions (the second row joining later, in cache row 1) equal the layer run over each
row's whole sequence, with its conv bias, in_proj / out_proj biases, two groups of B / C, D, and
a dt clamp that bites; a stale cache is reset at position 0, an fp16 conv window rounds as the
module's does, and Granite's residual multiplier scales both sub-blocks' outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fixtures.fused_steps import rel_err

from kernels.cpu.build import library
from kernels.cpu.decode import NO_ATTENTION, Block, Blocks
from kernels.cpu.mamba import Mamba

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the step is unfused")

HIDDEN, HEADS, P, GROUPS, N, K = 32, 4, 16, 2, 16, 4
CONFIG = dict(
    hidden_size=HIDDEN,
    mamba_n_heads=HEADS,
    mamba_d_head=P,
    mamba_expand=HEADS * P // HIDDEN,
    mamba_n_groups=GROUPS,
    mamba_d_state=N,
    mamba_d_conv=K,
    mamba_conv_bias=True,
    mamba_proj_bias=True,
    rms_norm_eps=1e-5,
    num_hidden_layers=1,
    layer_types=["mamba"],
)
STEPS, LATE = 9, 3  # row 1 joins at step 3
INTER = 32  # the block's gated MLP after the layer
MLP = [torch.randn(2 * INTER, HIDDEN, generator=torch.Generator().manual_seed(2)) * 0.2,
       torch.randn(HIDDEN, INTER, generator=torch.Generator().manual_seed(3)) * 0.2]  # fmt: skip


@pytest.fixture(scope="module")
def layer():
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf

    torch.manual_seed(0)
    cfg = GraniteMoeHybridConfig(**CONFIG, time_step_limit=(0.05, 0.6))
    mod = hf.GraniteMoeHybridMambaLayer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        mod.dt_bias.add_(0.5)  # softplus of dt + bias spreads both sides of the clamp
    return mod


def view(mod, conv_state, state) -> Mamba:
    return Mamba(
        in_proj=mod.in_proj.weight.detach(),
        in_bias=mod.in_proj.bias.detach(),
        out_proj=mod.out_proj.weight.detach(),
        out_bias=mod.out_proj.bias.detach(),
        conv=mod.conv1d.weight.detach().reshape(-1, K).contiguous(),
        conv_bias=mod.conv1d.bias.detach(),
        neg_a=-mod.A_log.detach().exp(),
        dt_bias=mod.dt_bias.detach(),
        d=mod.D.detach(),
        dt_limit=mod.time_step_limit,
        norm=mod.norm.weight.detach(),
        eps=mod.norm.variance_epsilon,
        conv_state=conv_state,
        state=state,
        heads=HEADS,
        head_dim=P,
        groups=GROUPS,
        state_dim=N,
    )


def blocks(mamba: Mamba, scale: float) -> Blocks:
    """One block: Mamba2 in attention's place, then the gated MLP, unit norms."""
    ones = torch.ones(HIDDEN)
    b = Block(norm1=ones, eps1=1e-5, norm2=ones, eps2=1e-5, gate_up=MLP[0], gate_up_bias=None,
              down=MLP[1], down_bias=None, act="silu", intermediate=INTER, mamba=mamba,
              residual_scale=scale, **NO_ATTENTION)  # fmt: skip
    out = Blocks.build([b], HIDDEN)
    assert out is not None
    return out


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


def run(layer, half: bool, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Both rows' block outputs (2, STEPS(-LATE), HIDDEN) through the C step, and the block
    around transformers' layer: h = x + s layer(rms(x)); h + s down(silu(gate) up)(rms(h))."""
    conv_dim = HEADS * P + 2 * GROUPS * N
    conv = torch.full((2, conv_dim, K - 1), 7.0, dtype=torch.float16 if half else torch.float32)
    state = torch.full((2, HEADS, P, N), 7.0)  # stale: position 0 must reset both
    fused = blocks(view(layer, conv, state), scale)
    x = torch.randn(2, STEPS, HIDDEN, generator=torch.Generator().manual_seed(1))
    got = torch.zeros(2, STEPS, HIDDEN)
    for t in range(STEPS):
        rows = [0] if t < LATE else [0, 1]
        pos = torch.tensor([t, t - LATE][: len(rows)])
        h = torch.stack([x[0, t], x[1, t - LATE]][: len(rows)]).contiguous()
        fused(h, pos, [], torch.tensor(rows))
        got[0, t] = h[0]
        if len(rows) == 2:
            got[1, t - LATE] = h[1]
    with torch.no_grad():
        h = x + scale * torch.cat([layer(rms(x[:1])), layer(rms(x[1:]))])
        gate, up = (rms(h) @ MLP[0].T).chunk(2, dim=-1)
        want = h + scale * (F.silu(gate) * up) @ MLP[1].T
    want[1, STEPS - LATE :] = 0
    return got, want


def test_steps_equal_transformers_layer(layer):
    got, want = run(layer, half=False)
    assert rel_err(got, want) < 1e-5


def test_dt_clamp_and_d_move_the_output(layer):
    """The checks above can fail: without the clamp or D, transformers' layer moves."""
    with torch.no_grad():
        normed = torch.randn(1, 6, HIDDEN)
        base = layer(normed)
        limit, layer.time_step_limit = layer.time_step_limit, (0.0, float("inf"))
        unclamped = layer(normed)
        layer.time_step_limit = limit
        d = layer.D.clone()
        layer.D.zero_()
        no_d = layer(normed)
        layer.D.copy_(d)
    assert rel_err(unclamped, base) > 1e-2 and rel_err(no_d, base) > 1e-2


def test_fp16_conv_window(layer):
    """An fp16 window holds each input rounded to fp16: within fp16's rounding of the module."""
    got, want = run(layer, half=True)
    assert rel_err(got, want) < 3e-3


def test_residual_scale(layer):
    """Granite's residual_multiplier: each sub-block's output times it before its add."""
    got, want = run(layer, half=False, scale=0.25)
    assert rel_err(got, want) < 1e-5
    assert rel_err(got, run(layer, half=False)[1]) > 1e-2  # the scale moves the output
