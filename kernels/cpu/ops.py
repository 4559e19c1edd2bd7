"""Decode's small ops on CPUs, one C call each (kernels/cpu/ops.c, in build.py's library).

A decode step normalises and rotates a few hundred numbers per layer; the references do it in
chains of 6-20 torch ops of 2-6 microseconds each, most of an eager SmolLM2 step's time outside
its matmuls. Here each op is one ctypes call with the reference's arithmetic. fp32 CPU tensors
only, and only in eager mode (a compiled step fuses the references itself); anything else, or
a machine where the C library cannot be built, runs the reference.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.cpu.build import built, library

OPS = (
    "rms_norm",
    "rms_norm_residual",
    "apply_rope",
    "attention",
)  # what kernels.dispatch routes here


def _lib(*ts: torch.Tensor):
    """The C library where it takes these tensors, else None (the reference runs)."""
    if torch.compiler.is_compiling():  # checked first: a trace must not reach library()
        return None
    if all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ts):
        return library()
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """reference.rms_norm in one call."""
    lib = _lib(x, weight)
    if lib is None or not weight.is_contiguous():
        return reference.rms_norm(x, weight, eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    lib.zoo_rms_norm(x.data_ptr(), None, None, weight.data_ptr(), out.data_ptr(),
                     x.numel() // dim, dim, eps)  # fmt: skip
    return out


def rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rms_norm_residual in one call: (rms_norm(x + residual), x + residual)."""
    lib = _lib(x, residual, weight)
    if lib is None or x.shape != residual.shape:
        return reference.rms_norm_residual(x, residual, weight, eps)
    x, residual, weight = x.contiguous(), residual.contiguous(), weight.contiguous()
    out, h = torch.empty_like(x), torch.empty_like(x)
    dim = x.shape[-1]
    lib.zoo_rms_norm(x.data_ptr(), residual.data_ptr(), h.data_ptr(), weight.data_ptr(),
                     out.data_ptr(), x.numel() // dim, dim, eps)  # fmt: skip
    return out, h


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.apply_rope, in place (as the Triton kernel): q (B, Hq, T, D) and k (B, Hk, T,
    D) may be strided views of one projection's output, their last dim contiguous."""
    lib = _lib(q, k, cos, sin)
    ok = (
        lib is not None
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == sin.shape
        and cos.shape[0] in (1, q.shape[0])
    )
    if not ok:
        return reference.apply_rope(q, k, cos, sin, interleaved)
    half = cos.shape[-1]
    cb = half * cos.shape[1] if cos.shape[0] > 1 else 0
    for x in (q, k):
        b, h, t, _ = x.shape
        lib.zoo_rope(x.data_ptr(), b, h, t, x.stride(0), x.stride(1), x.stride(2),
                     cos.data_ptr(), sin.data_ptr(), cb, half, interleaved)  # fmt: skip
    return q, k


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start_pos: int | torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """reference.attention, one query per row (decode) as one C call: eager with a window,
    soft-cap or sinks (the reference builds a mask, or runs its matmul-and-softmax path; plain,
    SDPA's batched products beat this one-key-at-a-time loop at short contexts, 16 against 22
    us at 100 tokens with SmolLM2's heads), and always inside a compiled decode step, through
    the custom op `zoo::decode_attention`: there the reference multiplies the whole cache
    bucket (256 slots or more), the C loop only each row's own positions. Prefill stays on the
    reference."""
    if q.shape[2] == 1 and q.dtype == torch.float32 and q.device.type == "cpu":
        if torch.compiler.is_compiling():
            if isinstance(start_pos, torch.Tensor) and built():
                return _decode_attention_op(q, k, v, start_pos, scale, window, softcap, sinks)
        elif window is not None or softcap is not None or sinks is not None:
            out = _decode(q, k, v, start_pos, scale, window, softcap, sinks)
            if out is not None:
                return out
    return reference.attention(q, k, v, start_pos, scale, window, softcap, sinks)


def _decode(q, k, v, start_pos, scale, window, softcap, sinks) -> torch.Tensor | None:
    """The C decode attention, or None where these inputs do not fit it."""
    lib = _lib(q, k, v)
    per_row = isinstance(start_pos, torch.Tensor)
    ok = (
        lib is not None
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and (sinks is None or (sinks.dtype == torch.float32 and sinks.is_contiguous()))
        and (not per_row or start_pos.device.type == "cpu")
    )
    if not ok:
        return None
    b, hq, _, d = q.shape
    hk, s, dv = k.shape[1], k.shape[2], v.shape[-1]
    out = q.new_empty(b, hq, 1, dv)
    pos = start_pos.to(torch.int64).contiguous() if per_row else None
    lib.zoo_decode_attention(
        q.data_ptr(), q.stride(0), q.stride(1),
        k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        v.data_ptr(), v.stride(0), v.stride(1), v.stride(2),
        out.data_ptr(), b, hq, hk, s, d, dv,
        pos.data_ptr() if per_row else None, 0 if per_row else start_pos, window or 0,
        scale, softcap or 0.0, sinks.data_ptr() if sinks is not None else None,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


@torch.library.custom_op("zoo::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start_pos: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One-query attention for a compiled step (the C call; the reference where it cannot)."""
    out = _decode(q, k, v, start_pos, scale, window, softcap, sinks)
    if out is None:
        out = reference.attention(q, k, v, start_pos, scale, window, softcap, sinks).contiguous()
    return out


@_decode_attention_op.register_fake
def _(q, k, v, start_pos, scale, window, softcap, sinks):
    return q.new_empty(q.shape[0], q.shape[1], 1, v.shape[-1])
