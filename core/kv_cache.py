"""The static KV cache: allocated once, written in place, never reallocated."""

import torch
from torch import nn

from core.config import RuntimeConfig


class StaticKVCache(nn.Module):
    """k, v: (layers, max_batch_size, kv_heads, max_seq_len, head_dim) in the model dtype."""

    def __init__(
        self,
        cfg: RuntimeConfig,
        max_batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__()
        a = cfg.attention
        shape = (cfg.num_layers, max_batch_size, a.num_kv_heads, max_seq_len, a.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()
