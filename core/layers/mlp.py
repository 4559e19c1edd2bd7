"""The dense MLP (`DenseMLPSpec`). Gated: down(act(gate(x)) * up(x)), gate and up fused into
one matmul; act is SiLU (SwiGLU) or GELU with the tanh approximation (GeGLU). Not gated
(Nemotron-H): down(act(up(x))), act squared ReLU (relu2)."""

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from core.config import DenseMLPSpec
from core.layers.linear import FusedLinear, Linear


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU, relu(x) ** 2 (transformers' ACT2FN["relu2"])."""
    return torch.square(F.relu(x))


class GatedMLP(nn.Module):
    """The module of every DenseMLPSpec; with `spec.gated` False it holds up_proj alone."""

    def __init__(self, hidden: int, spec: DenseMLPSpec):
        super().__init__()
        i = spec.intermediate_size
        self.gated = spec.gated
        if (spec.act == "relu2") == spec.gated:
            raise ValueError(f"DenseMLPSpec: act {spec.act!r} with gated={spec.gated}; the gated "
                             "MLP takes silu or gelu_tanh, the other relu2")  # fmt: skip
        if spec.gated:
            self.gate_up_proj = FusedLinear(hidden, {"gate": i, "up": i}, bias=spec.bias)
        else:
            self.up_proj = Linear(hidden, i, bias=spec.bias)
        self.down_proj = Linear(i, hidden, bias=spec.bias)
        self.act = spec.act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:  # torch only: no kernel of its own yet
            return self.down_proj(relu2(self.up_proj(x)))
        gate_up = self.gate_up_proj(x)  # (..., 2I): [gate | up]
        if self.act == "silu":
            return self.down_proj(kernels.swiglu(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # GeGLU: no kernel of its own yet
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
