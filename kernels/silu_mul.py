"""SwiGLU: silu(gate) * up from the fused gate_up projection (..., 2I) in one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.casting import round_to
from kernels.dispatch import interpreting, require

INTERPRETED = interpreting()
TILE = 4096  # elements per program


@triton.jit
def _silu_mul_kernel(
    GU,
    OUT,
    n_rows,
    n_cols,
    stride_gu,
    stride_out,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    gate = GU + rows[:, None] * stride_gu + cols[None, :]
    g = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate + n_cols, mask=mask, other=0.0).to(tl.float32)
    # F.silu rounds to the input dtype before the product, as the reference does
    act = round_to(g / (1.0 + tl.exp(-g)), OUT.dtype.element_ty).to(tl.float32)
    out = round_to(act * u, OUT.dtype.element_ty)
    tl.store(OUT + rows[:, None] * stride_out + cols[None, :], out, mask=mask)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (..., 2I) holding [gate | up] -> silu(gate) * up, (..., I) in the same dtype."""
    two_i = gate_up.shape[-1]
    require(two_i % 2 == 0, "swiglu", f"last dim {two_i} of gate_up must be even (gate | up)")
    n = two_i // 2
    out = torch.empty((*gate_up.shape[:-1], n), dtype=gate_up.dtype, device=gate_up.device)
    gu = gate_up.reshape(-1, two_i)
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    rows = gu.shape[0]
    if rows == 0 or n == 0:
        return out
    # few rows (decode): narrow column blocks so one token still spreads over many programs
    block = min(triton.next_power_of_2(n), 1024 if rows >= 64 else 256)
    block_rows = max(1, min(TILE // block, triton.next_power_of_2(rows)))
    o2 = out.view(-1, n)
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(n, block))
    _silu_mul_kernel[grid](
        gu, o2, rows, n, gu.stride(0), o2.stride(0), BLOCK_ROWS=block_rows, BLOCK=block
    )
    return out
