"""The gated MLP: down(act(gate(x)) * up(x)), gate and up fused into one matmul; act is SiLU
(SwiGLU) or GELU with the tanh approximation (GeGLU)."""

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from core.config import DenseMLPSpec
from core.layers.linear import FusedLinear, Linear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, spec: DenseMLPSpec):
        super().__init__()
        i = spec.intermediate_size
        self.gate_up_proj = FusedLinear(hidden, {"gate": i, "up": i}, bias=spec.bias)
        self.down_proj = Linear(i, hidden, bias=spec.bias)
        self.act = spec.act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (..., 2I): [gate | up]
        if self.act == "silu":
            return self.down_proj(kernels.swiglu(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # GeGLU: no kernel of its own yet
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
