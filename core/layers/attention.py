"""Grouped-query attention over the static KV cache."""

import torch
from torch import nn

import kernels
from core.config import GQASpec
from core.kv_cache import cache_write
from core.layers.linear import FusedLinear, Linear


class GQAAttention(nn.Module):
    def __init__(self, hidden: int, spec: GQASpec, rope_interleaved: bool = False):
        super().__init__()
        self.spec = spec
        self.interleaved = rope_interleaved
        hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.sizes = (hq * d, hkv * d, hkv * d)
        parts = dict(zip(("q", "k", "v"), self.sizes, strict=True))
        self.qkv_proj = FusedLinear(hidden, parts, bias=spec.qkv_bias)
        self.o_proj = Linear(hq * d, hidden, bias=spec.o_bias)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, hidden)
        cos: torch.Tensor,  # (1, T, rot/2) fp32
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # (B_max, H_kv, S_max, D), written in place
        v_cache: torch.Tensor,
        start_pos: int | torch.Tensor,  # an int, or (B,) per-row positions
        end: int,  # max(start_pos) + T: how much of the cache attention reads
    ) -> torch.Tensor:
        b, t, _ = x.shape
        s = self.spec
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(b, t, s.num_heads, s.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = k.view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        q, k = kernels.apply_rope(q, k, cos, sin, self.interleaved)
        keys = cache_write(k_cache, k, start_pos, end, seq_dim=2)
        values = cache_write(v_cache, v, start_pos, end, seq_dim=2)
        o = kernels.attention(q, keys, values, start_pos, s.scale)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, s.num_heads * s.head_dim))
