"""The static KV cache: allocated once, written in place, never reallocated.

What a layer caches per token is the attention kind's business: its spec's `cache_layout`
names the tensors (GQA: `k`, `v`; MLA: `latent`, `k_pe`) and their per-layer shapes. The cache
stacks each over the layers and hands a layer its slices in that order.
"""

import torch
from torch import nn

from core.config import RuntimeConfig


class StaticKVCache(nn.Module):
    """One buffer per cached tensor: (layers, *cache_layout shape) in the model dtype.

    GQA: k, v (layers, max_batch_size, kv_heads, max_seq_len, head_dim);
    MLA: latent (layers, max_batch_size, max_seq_len, kv_lora_rank), k_pe (..., qk_rope_head_dim).
    """

    def __init__(
        self,
        cfg: RuntimeConfig,
        max_batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__()
        layout = cfg.attention.cache_layout(max_batch_size, max_seq_len)
        self.names = tuple(layout)
        for name, shape in layout.items():
            buf = torch.zeros((cfg.num_layers, *shape), dtype=dtype, device=device)
            self.register_buffer(name, buf, persistent=False)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, n).nbytes for n in self.names)

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        """Layer i's cache tensors, in the order its attention's forward() takes them."""
        return tuple(getattr(self, n)[i] for n in self.names)

    def reset(self) -> None:
        for n in self.names:
            getattr(self, n).zero_()


def cache_write(
    cache: torch.Tensor, new: torch.Tensor, start_pos: int | torch.Tensor, end: int, seq_dim: int
) -> torch.Tensor:
    """Write `new` (B, ..., T, ...) into cache rows [:B] at positions start_pos.. along
    `seq_dim` (an int, or a (B,) tensor of per-row positions); return cache[:B] up to `end`,
    the slice attention reads (end >= every row's start_pos + T)."""
    b, t = new.shape[0], new.shape[seq_dim]
    rows = cache[:b]
    if isinstance(start_pos, int):
        rows.narrow(seq_dim, start_pos, t).copy_(new)
    else:
        pos = start_pos[:, None] + torch.arange(t, device=new.device)  # (B, T)
        index = torch.arange(b, device=new.device)[:, None]
        rows.movedim(seq_dim, 1)[index, pos] = new.movedim(seq_dim, 1)
    return rows.narrow(seq_dim, 0, end)
