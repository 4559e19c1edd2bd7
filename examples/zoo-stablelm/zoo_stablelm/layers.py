"""Gemma's two layer kinds, as the core builds them: `Module(hidden, spec)`."""

import torch
import torch.nn.functional as F
from torch import nn

from core.layers import FusedLinear, Linear
from zoo_gemma.config import GeGLUSpec, GemmaRMSNormSpec


class GemmaRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as an offset from 1 (zeros = identity)."""

    def __init__(self, dim: int, spec: GemmaRMSNormSpec):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = spec.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # (..., dim) fp32, as transformers: normalise and scale, then cast back
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GeGLU(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)); gate and up fused into one matmul, as in the core's
    SwiGLU MLP, so the checkpoint's gate_proj / up_proj fill the shards of `gate_up_proj`."""

    def __init__(self, hidden: int, spec: GeGLUSpec):
        super().__init__()
        i = spec.intermediate_size
        self.gate_up_proj = FusedLinear(hidden, {"gate": i, "up": i})
        self.down_proj = Linear(i, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
