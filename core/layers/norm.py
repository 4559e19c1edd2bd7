"""RMSNorm with fp32 accumulation; Gemma's (offset + weight) form in fp32 throughout."""

import torch
from torch import nn

import kernels
from core.config import RMSNormSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, spec: RMSNormSpec):
        super().__init__()
        # a plugin's own norm spec subclassing this module may know only eps (no offset)
        offset = getattr(spec, "offset", 0.0)
        # identity at init; a factory call, not arithmetic: on the meta device (where models
        # are built) arithmetic runs Python references that import torch._dynamo (~1.2 s)
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.eps, self.offset = spec.eps, offset
        self.fp32_scale = getattr(spec, "fp32_scale", False)

    def scale(self) -> torch.Tensor:
        """What the normed x is multiplied by: the weight, or Gemma's (offset + w) in fp32 (Gemma
        4's w in fp32)."""
        if not self.offset:
            return self.weight.float() if self.fp32_scale else self.weight
        return self.weight.float() + self.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.offset and not self.fp32_scale:
            return kernels.rms_norm(x, self.weight, self.eps)
        # Gemma: (offset + w) and the product in fp32, cast back once (the kernel's rounding
        # casts before scaling); in fp32 the two agree. Gemma 4 (fp32_scale): w itself, the same way
        return kernels.rms_norm(x.float(), self.scale(), self.eps).to(x.dtype)
