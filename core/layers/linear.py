"""A linear layer whose output rows are several checkpoint tensors stacked (q|k|v, gate|up).

Each part is a named shard; the loader fills shard `name` of the weight (and bias) from the
checkpoint tensor the weight map points at it, so fusing is declared as data, not code.
"""

from torch import nn


class FusedLinear(nn.Linear):
    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        shards, offset = {}, 0
        for name, size in parts.items():
            shards[name] = (slice(offset, offset + size),)  # index into dim 0
            offset += size
        for p in self.parameters():
            p.shards = shards
