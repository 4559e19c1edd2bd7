"""`Linear` (nn.Linear through `kernels.linear`), and `FusedLinear`, whose output rows are
several checkpoint tensors stacked (q|k|v, gate|up).

Each part is a named shard; the loader fills shard `name` of the weight (and bias) from the
checkpoint tensor the weight map points at it, so fusing is declared as data, not code.
"""

import torch
from torch import nn

import kernels


class Linear(nn.Linear):
    """nn.Linear through `kernels.linear` (the CPU decode fast path); same parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        shards, offset = {}, 0
        for name, size in parts.items():
            shards[name] = (slice(offset, offset + size),)  # index into dim 0
            offset += size
        for p in self.parameters():
            p.shards = shards
