"""What the fused CPU step's Python views share (kernels/cpu/decode.py, moe.py, delta.py,
mamba.py, mla.py): step.h's zlinear_t of a weight of up to MAX_PARTS parts (fp32, `BlockWeight`,
or a `QuantStack` of them), and the checks of the tensors the C code reads."""

from __future__ import annotations

import ctypes

import torch

from kernels.blocks import BlockWeight
from kernels.cpu.build import QWeightView
from kernels.qweight import QuantStack

MAX_PARTS = 4  # as step.h
ACTS = {"silu": 0, "gelu_tanh": 1, "relu2": 2}  # relu2: a non-gated MLP (step.h ZOO_RELU2)
I64, PTR, F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class CLinear(ctypes.Structure):
    _fields_ = [("part", QWeightView * MAX_PARTS), ("parts", I64), ("N", I64), ("bias", PTR)]


def is_fp32(t: torch.Tensor | None) -> bool:
    """None, or an fp32 contiguous CPU tensor (what the C step reads as floats)."""
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


def weight_parts(weight) -> list[QWeightView] | None:
    """The C views of a weight's parts, or None where the C step cannot take it."""
    if isinstance(weight, QuantStack):
        views = [weight_parts(p) for p in weight.parts]
        return None if any(v is None for v in views) else [x for v in views for x in v]
    if isinstance(weight, BlockWeight):
        return [weight.c_view()]
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and is_fp32(weight):
        return [QWeightView(weight.data_ptr(), *weight.shape, 0)]
    return None


def linear_view(weight, bias: torch.Tensor | None, keep: list) -> CLinear | None:
    """step.h's zlinear_t of a weight (and bias), kept alive in `keep`; None where the C
    step cannot take it."""
    parts = weight_parts(weight)
    if parts is None or len(parts) > MAX_PARTS or not is_fp32(bias):
        return None
    keep.append((weight, bias))
    out = CLinear(parts=len(parts), N=sum(p.N for p in parts), bias=address(bias))
    for i, p in enumerate(parts):
        out.part[i] = p
    return out


def address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def cache_ok(t: torch.Tensor, dims: int, half: bool) -> bool:
    """A CPU cache of `dims` dims, rows contiguous, fp16 where `half` else fp32."""
    return (
        t.dim() == dims and t.stride(-1) == 1 and t.device.type == "cpu"
        and t.dtype == (torch.float16 if half else torch.float32)
    )  # fmt: skip


def norm_ok(norm: tuple[torch.Tensor, float] | None, n: int) -> bool:
    return norm is not None and is_fp32(norm[0]) and norm[0].shape == (n,)


def conv_cache_ok(t: torch.Tensor, channels: int, kernel: int) -> bool:
    """A conv window cache (B, channels, kernel - 1) on the CPU, contiguous, fp16 or fp32."""
    return (
        t.is_contiguous() and t.device.type == "cpu" and t.shape[1:] == (channels, kernel - 1)
        and t.dtype in (torch.float16, torch.float32)
    )  # fmt: skip
