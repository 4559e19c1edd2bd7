"""The static KV cache: allocated once, written in place, never reallocated.

What a layer caches per token is the attention kind's business: its spec's `cache_layout`
names the tensors (GQA: `k`, `v`; MLA: `latent`, `k_pe`) and their shapes; a sliding GQA layer
asks for `min(window, max_seq_len)` positions (its ring buffer); a recurrent layer (gated
DeltaNet: `conv`, `state`) a fixed-size state per row, which the layer itself starts from zero
for a row whose input begins at position 0 (a reused row needs no reset). A spec may keep a
tensor in another dtype than the model's (`cache_dtypes`: the delta-rule state in fp32). The
cache allocates each layer's own layout and hands a layer its tensors, in that order.
"""

import torch

from core.config import RuntimeConfig


class StaticKVCache:
    """Per layer, one buffer per cached tensor in the model dtype, allocated once.

    GQA: k, v (max_batch_size, kv_heads, max_seq_len or min(window, max_seq_len), head_dim);
    MLA: latent (max_batch_size, max_seq_len, kv_lora_rank), k_pe (..., qk_rope_head_dim).
    Each layer owns its buffers (not views of one stacked tensor), so a compiled decode step
    writes them in place instead of copying a shared base.
    """

    def __init__(
        self,
        cfg: RuntimeConfig,
        max_batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        specs = cfg.attention_layers
        layouts = [spec.cache_layout(max_batch_size, max_seq_len) for spec in specs]
        self.names = [tuple(layout) for layout in layouts]  # per layer
        self.layers = []
        for spec, layout in zip(specs, layouts, strict=True):
            own = spec.cache_dtypes() if hasattr(spec, "cache_dtypes") else {}
            self.layers.append(
                tuple(
                    torch.zeros(
                        shape,
                        dtype=getattr(torch, own[name]) if name in own else dtype,
                        device=device,
                    )
                    for name, shape in layout.items()
                )
            )
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for bufs in self.layers for t in bufs)

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        """Layer i's cache tensors, in the order its attention's forward() takes them."""
        return self.layers[i]

    def reset(self) -> None:
        for bufs in self.layers:
            for t in bufs:
                t.zero_()


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
        # One index_put_ on the whole buffer (not on a view of it), which a compiled step
        # keeps in place: index tensors for batch, the dims before seq_dim, and positions,
        # broadcasting to new's leading (B, ..., T) shape.
        def along(values: torch.Tensor, *dims: int) -> torch.Tensor:
            shape = [1] * (seq_dim + 1)
            for d in dims:
                shape[d] = new.shape[d]
            return values.view(shape)

        index = [along(torch.arange(new.shape[d], device=new.device), d) for d in range(seq_dim)]
        pos = start_pos[:, None] + torch.arange(t, device=new.device)  # (B, T)
        index.append(along(pos, 0, seq_dim))
        cache.index_put_(tuple(index), new)
    return rows.narrow(seq_dim, 0, end)
