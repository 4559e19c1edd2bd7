"""RMSNorm, and RMSNorm fused with the residual add: fp32 accumulation, a few rows per program.

Rounds like `reference.rms_norm` (normalise in fp32, cast to x's dtype, then scale by the
weight), so results differ from the reference only by the order of the fp32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.casting import round_to
from kernels.dispatch import interpreting, require

INTERPRETED = interpreting()  # whether the kernels below were decorated for the interpreter
TILE = 4096  # elements per program: several rows when the hidden size is small


@triton.jit
def _rms_norm_kernel(
    X,
    R,  # residual (read only when HAS_RESIDUAL)
    W,
    Y,
    H_OUT,  # x + residual, written when HAS_RESIDUAL
    n_rows,
    n_cols,
    stride_x,
    stride_r,
    stride_y,
    stride_h,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        h = round_to(x + r.to(tl.float32), X.dtype.element_ty)  # the stream keeps x's dtype
        tl.store(H_OUT + rows[:, None] * stride_h + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # (BLOCK_ROWS,)
    normed = round_to(x * rstd[:, None], X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    y = round_to(normed * w[None, :], Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x, residual, weight, eps, op):
    n = x.shape[-1]
    require(weight.shape == (n,), op, f"weight {tuple(weight.shape)} must be ({n},)")
    require(weight.device == x.device, op, f"weight on {weight.device}, x on {x.device}")
    if residual is not None:
        require(residual.shape == x.shape, op, f"residual {residual.shape} != x {x.shape}")
        require(residual.dtype == x.dtype, op, f"residual {residual.dtype} != x {x.dtype}")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)  # as `weight * h` in the reference
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    h = torch.empty_like(x) if residual is not None else None
    x2 = _rows(x, n)
    rows = x2.shape[0]
    if rows == 0 or n == 0:
        return y, h
    r2 = _rows(residual, n) if residual is not None else x2
    y2 = y.view(-1, n)
    h2 = h.view(-1, n) if h is not None else y2
    block = triton.next_power_of_2(n)
    block_rows = max(1, min(TILE // block, triton.next_power_of_2(rows)))
    _rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
        x2,
        r2,
        weight.contiguous(),
        y2,
        h2,
        rows,
        n,
        x2.stride(0),
        r2.stride(0),
        y2.stride(0),
        h2.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_ROWS=block_rows,
        BLOCK=block,
        num_warps=4 if block * block_rows < 4096 else 8 if block * block_rows < 16384 else 16,
    )
    return y, h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., H) -> x * rsqrt(mean(x^2) + eps) * weight, in promote(x, weight) dtype."""
    return _launch(x, None, weight, eps, "rms_norm")[0]


def rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (x's dtype); returns (rms_norm(h), h) from one read of x and residual."""
    return _launch(x, residual, weight, eps, "rms_norm_residual")
