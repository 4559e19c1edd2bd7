"""The C view of a gated short-conv layer (LFM2) for the fused CPU step (kernels/cpu/
shortconv.c, step.h's zsconv_t): its projections, conv filters and bias, and its cache (the
conv window)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu.build import MAX_ROWS
from kernels.cpu.views import I64, PTR, CLinear, address, is_fp32, linear_view


class CShortConv(ctypes.Structure):  # step.h's zsconv_t
    _fields_ = [
        ("in_proj", CLinear), ("out_proj", CLinear), ("kernel", I64), ("conv_w", PTR),
        ("conv_b", PTR), ("conv", PTR), ("conv_sb", I64), ("conv_half", I64), ("scratch", PTR),
    ]  # fmt: skip


@dataclass
class ShortConvLayer:
    """A gated short-conv layer the C step takes in place of attention (shortconv.c): in_proj
    (3 hidden rows B | C | x) and out_proj, fp32 or `BlockWeight` / `QuantStack`, with their
    biases or None; the conv's filters (hidden, K) and bias (hidden,) or None, fp32; its cache:
    the conv window (B, hidden, K - 1) fp32 or fp16."""

    in_proj: object
    in_bias: torch.Tensor | None
    out_proj: object
    out_bias: torch.Tensor | None
    conv: torch.Tensor
    conv_bias: torch.Tensor | None
    conv_state: torch.Tensor


def sconv_scratch(layers: list[ShortConvLayer], hidden: int) -> torch.Tensor:
    """step.h's zsconv_t.scratch: MAX_ROWS rows of in_proj's output (3 hidden) and the conv's."""
    return torch.zeros(MAX_ROWS * 4 * hidden if layers else 0)


def sconv_view(s: ShortConvLayer, hidden: int, scratch: torch.Tensor, keep: list):
    """step.h's zsconv_t of s, kept alive in `keep`; None where the C step cannot take it.
    scratch: `sconv_scratch`'s, shared by the layers (they run one by one)."""
    lin = [linear_view(s.in_proj, s.in_bias, keep), linear_view(s.out_proj, s.out_bias, keep)]
    if any(x is None for x in lin) or (3 * hidden, hidden) != (lin[0].N, lin[1].N):
        return None
    if [p.K for x in lin for p in x.part[: x.parts]] != [hidden] * (lin[0].parts + lin[1].parts):
        return None
    k = s.conv.shape[-1]
    if not (is_fp32(s.conv) and s.conv.shape == (hidden, k) and is_fp32(s.conv_bias)):
        return None
    state, half = s.conv_state, s.conv_state.dtype == torch.float16
    ok = state.is_contiguous() and state.device.type == "cpu" and state.shape[1:] == (hidden, k - 1)
    if not ok or state.dtype not in (torch.float16, torch.float32):
        return None
    z = CShortConv(in_proj=lin[0], out_proj=lin[1], kernel=k, conv_half=half)
    z.conv_w, z.conv_b = s.conv.data_ptr(), address(s.conv_bias)
    z.conv, z.conv_sb, z.scratch = state.data_ptr(), state.stride(0), scratch.data_ptr()
    keep.append((s, z))
    return z
