"""StableLM's layer kind, as the core builds it: `Module(hidden, spec)`."""

import torch
import torch.nn.functional as F
from torch import nn

from zoo_stablelm.config import LayerNormSpec


class LayerNorm(nn.Module):
    """A LayerNorm with weight and bias, named as the checkpoint names them (`.weight`,
    `.bias`); computed in the input's dtype, as transformers' nn.LayerNorm."""

    def __init__(self, dim: int, spec: LayerNormSpec):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = spec.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
