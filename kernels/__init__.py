"""Shared kernel ops. Core layers call `kernels.<op>()` only; the dispatch here picks the
implementation. Today every op runs its torch reference (`kernels.reference`); Triton
launchers plug in per op behind `ZOO_KERNELS=triton|torch`."""

from kernels.reference import apply_rope, attention, mla_attention, moe_experts, rms_norm, swiglu

__all__ = ["apply_rope", "attention", "mla_attention", "moe_experts", "rms_norm", "swiglu"]
