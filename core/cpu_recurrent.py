"""The fused CPU decode step's views of the recurrent layers (core/cpu_step.py): a gated
DeltaNet, a Mamba2 layer or a gated short conv, with the row states of its cache, as the C
step reads them (kernels/cpu/delta.py, mamba.py, shortconv.py)."""

from __future__ import annotations

import torch

from core.layers.deltanet import GatedDeltaNet
from core.layers.mamba2 import Mamba2
from core.layers.shortconv import ShortConv
from kernels.cpu.delta import Delta
from kernels.cpu.mamba import Mamba
from kernels.cpu.shortconv import ShortConvLayer

RECURRENT = (GatedDeltaNet, Mamba2, ShortConv)


def recurrent_view(attn, *cache: torch.Tensor) -> dict:
    """A Block's fields for a recurrent layer: its view under the field name the C step reads."""
    if type(attn) is GatedDeltaNet:
        return {"delta": _delta(attn, *cache)}
    if type(attn) is Mamba2:
        return {"mamba": _mamba(attn, *cache)}
    return {"sconv": _sconv(attn, *cache)}


def _delta(attn: GatedDeltaNet, conv: torch.Tensor, state: torch.Tensor) -> Delta:
    """The C step's view of a gated DeltaNet layer and its cache (conv window, state)."""
    s = attn.spec
    return Delta(
        in_proj=attn.in_proj.weight,
        grouped=s.layout == "grouped",
        out_proj=attn.out_proj.weight,
        conv=attn.conv1d.weight.reshape(s.conv_dim, s.conv_kernel),
        neg_a=-attn.A_log.float().exp(),  # as the module computes it (a copy)
        dt_bias=attn.dt_bias.float(),
        norm=attn.norm.weight,
        eps=s.norm_eps,
        conv_state=conv,
        state=state,
        k_heads=s.num_k_heads,
        v_heads=s.num_v_heads,
        k_dim=s.head_k_dim,
        v_dim=s.head_v_dim,
    )


def _mamba(attn: Mamba2, conv: torch.Tensor, state: torch.Tensor) -> Mamba:
    """The C step's view of a Mamba2 layer and its cache (conv window, SSM state)."""
    s = attn.spec
    conv_bias = attn.conv1d.bias
    return Mamba(
        in_proj=attn.in_proj.weight,
        in_bias=attn.in_proj.bias,
        out_proj=attn.out_proj.weight,
        out_bias=attn.out_proj.bias,
        conv=attn.conv1d.weight.reshape(s.conv_dim, s.conv_kernel),
        conv_bias=None if conv_bias is None else conv_bias.float(),
        neg_a=-attn.A_log.float().exp(),  # as the module computes it (a copy)
        dt_bias=attn.dt_bias.float(),
        d=attn.D.float(),
        dt_limit=s.time_step_limit,
        norm=attn.norm.weight,
        eps=s.norm_eps,
        conv_state=conv,
        state=state,
        heads=s.num_heads,
        head_dim=s.head_dim,
        groups=s.n_groups,
        state_dim=s.state_size,
    )


def _sconv(attn: ShortConv, conv: torch.Tensor) -> ShortConvLayer:
    """The C step's view of a gated short-conv layer and its cache (the conv window)."""
    w = attn.conv.weight
    return ShortConvLayer(
        in_proj=attn.in_proj.weight,
        in_bias=attn.in_proj.bias,
        out_proj=attn.out_proj.weight,
        out_bias=attn.out_proj.bias,
        conv=w.reshape(w.shape[0], w.shape[-1]),
        conv_bias=attn.conv.bias,
        conv_state=conv,
    )
