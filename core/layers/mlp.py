"""The gated MLP: down(act(gate(x)) * up(x)), gate and up fused into one matmul."""

import torch
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.swiglu(self.gate_up_proj(x)))
