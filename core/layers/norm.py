"""RMSNorm with fp32 accumulation; Gemma's (offset + weight) form in fp32 throughout; the
weightless L2 norm of Llama 4's q and k."""

import torch
from torch import nn

import kernels
from core.config import L2NormSpec, RMSNormSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, spec: RMSNormSpec):
        super().__init__()
        # a plugin's own norm spec subclassing this module may know only eps (no offset)
        offset = getattr(spec, "offset", 0.0)
        # identity at init; a factory call, not arithmetic: on the meta device (where models
        # are built) arithmetic runs Python references that import torch._dynamo (~1.2 s)
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.eps, self.offset = spec.eps, offset
        self.fp32_scale = getattr(spec, "fp32_scale", False) or getattr(spec, "fp32_weight", False)
        if getattr(spec, "fp32_weight", False):  # DeepSeek V4: loaded in fp32 whatever the dtype
            self.weight.keep_fp32 = True

    def scale(self) -> torch.Tensor:
        """What the normed x is multiplied by: the weight, or Gemma's (offset + w) in fp32."""
        if not self.offset and not self.fp32_scale:
            return self.weight
        return self.weight.float() + self.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.offset and not self.fp32_scale:
            return kernels.rms_norm(x, self.weight, self.eps)
        # Gemma: (offset + w) and the product in fp32, cast back once (the kernel's rounding
        # casts before scaling); in fp32 the two agree. OLMo, Gemma 4, DeepSeek V4 (fp32_scale):
        # the same with offset 0
        return kernels.rms_norm(x.float(), self.scale(), self.eps).to(x.dtype)


class L2Norm(nn.Module):
    """x / sqrt(mean(x^2) + eps) in fp32, cast back: an RMSNorm without weight (Llama 4)."""

    def __init__(self, dim: int, spec: L2NormSpec):
        super().__init__()
        self.eps = spec.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
