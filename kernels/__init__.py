"""Shared kernel ops. Core layers call `kernels.<op>()` only.

Each op dispatches (kernels/dispatch.py) to its Triton launcher on CUDA, or to its torch
reference (kernels/reference.py) elsewhere; `ZOO_KERNELS=auto|triton|torch` overrides.
Triton launchers live one op per file: rmsnorm.py, rope.py, silu_mul.py, decode_attention.py,
prefill_attention.py, moe.py, quant_matmul.py (quantized weights); CPU fast paths of plain
torch ops and the C kernels live in kernels/cpu/. (No file is named after an op: importing a
submodule `kernels.x` would overwrite the op function `kernels.x` that the layers call.)
"""

from kernels.dispatch import (
    KernelError,
    apply_rope,
    attention,
    gated_delta_rule,
    linear,
    mla_attention,
    moe_experts,
    quant_linear,
    rms_norm,
    rms_norm_residual,
    sparse_mla_attention,
    ssd_scan,
    swiglu,
)

__all__ = [
    "KernelError",
    "apply_rope",
    "attention",
    "gated_delta_rule",
    "linear",
    "mla_attention",
    "moe_experts",
    "quant_linear",
    "rms_norm",
    "rms_norm_residual",
    "sparse_mla_attention",
    "ssd_scan",
    "swiglu",
]
