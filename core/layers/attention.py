"""Grouped-query attention over the static KV cache, one spec per layer (`GQASpec`).

A full layer caches every position; a sliding layer (`spec.window`) keeps a ring buffer of its
last `R = min(window, max_seq_len)` positions, position p in slot p % R:
- decode (one token per row): the token is written to its slot, then attends to every filled
  slot (order does not matter to a softmax): all R once a row has passed R - 1, else 0..p.
- prefill (T tokens from start s): the chunk's queries need up to window - 1 keys before s,
  which the chunk itself may overwrite in the ring when T > 1. So the old keys are first read
  out in position order and the chunk's keys appended (`_ring_prefill`), attention runs over
  that with the window mask, and only then is the ring rewritten with each row's last R real
  positions (`lengths`: a right-padded row's padding must not evict its real keys).

A chunked layer (`spec.chunk`, Llama 4) caches every position as a full layer does; a query at
p reads only its chunk's slice, positions (p // chunk) * chunk .. p (`_chunked`).
"""

import torch
from torch import nn

import kernels
from core.config import GQASpec
from core.kv_cache import as_compute, cache_write
from core.layers.linear import FusedLinear, Linear
from core.plugins import registry


class GQAAttention(nn.Module):
    def __init__(self, hidden: int, spec: GQASpec, rope_interleaved: bool = False):
        super().__init__()
        self.spec = spec
        self.interleaved = rope_interleaved
        hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        gated = 2 if spec.output_gate else 1  # q_proj's rows per head: [q_h | gate_h]
        # a layer reading another's K/V (kv_source) projects q alone; k_eq_v: q and k
        own_k, own_v = spec.kv_source is None, spec.kv_source is None and not spec.k_eq_v
        sizes = {"q": gated * hq * d, "k": hkv * d if own_k else 0, "v": hkv * d if own_v else 0}
        self.sizes = tuple(sizes.values())
        parts = {name: n for name, n in sizes.items() if n}
        self.qkv_proj = FusedLinear(hidden, parts, bias=spec.qkv_bias)
        self.o_proj = Linear(hq * d, hidden, bias=spec.o_bias)
        if spec.qk_norm is not None:  # per head, over head_dim (Qwen3, Gemma 3)
            norm = registry().layer(spec.qk_norm)
            whole = spec.qk_norm_all_heads  # over all heads at once (OLMo 2 / 3, MiniMax M2)
            self.q_norm = norm(hq * d if whole else d, spec.qk_norm)
            if own_k:
                self.k_norm = norm(hkv * d if whole else d, spec.qk_norm)
        if spec.sinks:  # one logit per query head (gpt-oss)
            self.sinks = nn.Parameter(torch.zeros(hq))

    def forward(
        self,
        x: torch.Tensor,  # (B, T, hidden)
        cos: torch.Tensor | None,  # (1 or B, T, rot/2) fp32; None: a NoPE layer
        sin: torch.Tensor | None,
        k_cache: torch.Tensor,  # (B_max, H_kv, S_max or R, D), written in place
        v_cache: torch.Tensor,
        start_pos: int | torch.Tensor,  # an int, or (B,) per-row positions
        end: int,  # max(start_pos) + T: how much of the cache attention reads
        lengths: torch.Tensor | None = None,  # (B,) real tokens per row in x (right padding)
        shared: list | None = None,  # K/V handed between layers (kv_source), see below
    ) -> torch.Tensor:
        """`shared`: on a layer others read (Gemma 4), an empty list this layer appends what it
        attended over to, (keys, values, positions, window); on a `kv_source` layer, that
        list: it attends over the same, with its own queries."""
        b, t, _ = x.shape
        s = self.spec
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        if s.k_eq_v:  # K = V: a copy, since the norms and the rope kernel may turn k in place
            v = k.clone()
        per_head = s.qk_norm is not None and not s.qk_norm_all_heads
        if s.qk_norm_all_heads:  # (B, T, H * D), before the split into heads
            q = self.q_norm(q)
            k = self.k_norm(k) if s.kv_source is None else k
        if s.output_gate:  # (B, T, Hq, 2D) -> q and the output gate, (B, T, Hq, D) each
            q, gate = q.view(b, t, s.num_heads, 2 * s.head_dim).chunk(2, dim=-1)
        q = q.reshape(b, t, s.num_heads, s.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        if per_head:
            q = self.q_norm(q)
        if s.kv_source is not None:
            if cos is not None:  # the rope op turns q and k together: no k here, one dummy head
                dummy = q.new_zeros(b, 1, t, s.head_dim)
                q, _ = kernels.apply_rope(q, dummy, cos, sin, self.interleaved)
            kv = shared[0]
        else:
            k = k.view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
            v = v.view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
            if per_head:
                k = self.k_norm(k)
            if s.v_norm is not None:  # weightless, in fp32
                vf = v.float()
                v = (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + s.v_norm)).to(v.dtype)
            if cos is not None:
                q, k = kernels.apply_rope(q, k, cos, sin, self.interleaved)
            kv = self._cached(q, k, v, k_cache, v_cache, start_pos, end, lengths)
            if shared is not None:
                shared.append(kv)
        if s.query_scale is not None:
            q = self._scale_queries(q, start_pos)
        keys, values, pos, window = kv
        extra = dict(softcap=s.softcap, sinks=self.sinks if s.sinks else None)
        if s.chunk is not None:
            o = self._chunked(q, keys, values, start_pos, end, extra)
        else:
            o = kernels.attention(q, keys, values, pos, s.scale, window=window, **extra)
        o = o.transpose(1, 2).reshape(b, t, s.num_heads * s.head_dim)
        if s.output_gate:
            o = o * torch.sigmoid(gate.reshape(b, t, -1))
        return self.o_proj(o)

    def _cached(self, q, k, v, k_cache, v_cache, start_pos, end, lengths):
        """Write the new k, v into the cache -> (keys, values, positions, window): what the
        queries attend over, as kernels.attention takes them."""
        b, t = q.shape[0], q.shape[2]
        if self.spec.window is None:
            keys = as_compute(cache_write(k_cache, k, start_pos, end, seq_dim=2), q)
            values = as_compute(cache_write(v_cache, v, start_pos, end, seq_dim=2), q)
            return keys, values, start_pos, None
        if t > 1:
            return self._ring_prefill(q, k, v, k_cache, v_cache, start_pos, lengths)
        r = k_cache.shape[2]  # ring slots
        cache_write(k_cache, k, start_pos % r, 1, seq_dim=2)
        cache_write(v_cache, v, start_pos % r, 1, seq_dim=2)
        n = min(end, r)  # slots any row may read; each row reads 0..min(pos, r - 1)
        keys, values = as_compute(k_cache[:b, :, :n], q), as_compute(v_cache[:b, :, :n], q)
        rel = start_pos.clamp(max=r - 1) if torch.is_tensor(start_pos) else min(start_pos, r - 1)
        return keys, values, rel, None

    def _ring_prefill(self, q, k, v, k_cache, v_cache, start_pos, lengths):
        """T > 1 new tokens on a sliding layer: attend over [the ring's keys before start, in
        position order | the new keys], then store each row's last real positions."""
        b, _, t, _ = q.shape
        r, w = k_cache.shape[2], self.spec.window
        dev = q.device
        per_row = torch.is_tensor(start_pos)
        s = start_pos.to(dev).view(b, 1) if per_row else torch.full((b, 1), start_pos, device=dev)
        rel = s.clamp(max=w - 1)  # old keys each row's first query may see: (B, 1)
        span = (min(w - 1, r) if per_row else int(rel[0, 0])) + t  # gathered keys per row
        i = torch.arange(span, device=dev)[None]  # (1, L)
        # index into [ring slots 0..r-1 | new tokens r..r+t-1]; past a row's chunk: junk,
        # which causality hides (every query sits at or before rel + t - 1)
        old = (s - rel + i).remainder(r)
        src = torch.where(i < rel, old, (r + i - rel).clamp(max=r + t - 1))  # (B, L)
        # the ring after the write: slot j holds the latest real position p = j (mod r) before
        # the row's end; a new token if p >= start, else what it held
        stop = s + (lengths.to(dev).view(b, 1) if lengths is not None else t)  # (B, 1)
        j = torch.arange(r, device=dev)[None]
        p = stop - 1 - (stop - 1 - j).remainder(r)
        keep = torch.where(p >= s, r + p - s, j)  # (B, R)
        outs = []
        for cache, new in ((k_cache, k), (v_cache, v)):
            both = torch.cat((cache[:b], new.to(cache.dtype)), dim=2)  # (B, H, R + T, D)
            idx = src[:, None, :, None].expand(-1, both.shape[1], -1, both.shape[3])
            outs.append(as_compute(both.gather(2, idx), q))
            idx = keep[:, None, :, None].expand(-1, both.shape[1], -1, both.shape[3])
            cache[:b].copy_(both.gather(2, idx))
        rel_pos = rel.view(b) if per_row else int(rel[0, 0])
        return *outs, rel_pos, w

    def _scale_queries(self, q: torch.Tensor, start_pos: int | torch.Tensor) -> torch.Tensor:
        """q (B, Hq, T, D) times the spec's `QueryScale` factor at each query's position."""
        qs = self.spec.query_scale
        pos = torch.arange(q.shape[2], device=q.device)[None]  # (1, T)
        pos = pos + (start_pos.to(q.device)[:, None] if torch.is_tensor(start_pos) else start_pos)
        f = 1.0 + qs.beta * torch.log1p(torch.floor((pos.float() + qs.offset) / qs.period))
        f = f[:, None, :, None]  # (1 or B, 1, T, 1)
        return q * f.to(q.dtype) if qs.round_factor else (q * f).to(q.dtype)

    def _chunked(self, q, keys, values, start_pos, end, extra):
        """Chunked attention over the full cache's keys: each query sees its own chunk only."""
        c = self.spec.chunk
        if not torch.is_tensor(start_pos):
            return self._chunk_pieces(q, keys, values, start_pos, extra)
        if q.shape[2] > 1:  # several tokens at per-row positions: row by row
            rows = zip(q.split(1), keys.split(1), values.split(1), start_pos.tolist(), strict=True)
            return torch.cat([self._chunk_pieces(*row, extra) for row in rows])
        # one token per row at per-row positions: gather each row's chunk, in position order
        first = start_pos - start_pos % c  # (B,)
        n = min(c, end)
        idx = (first[:, None] + torch.arange(n, device=q.device)).clamp(max=end - 1)  # (B, n)
        idx = idx[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
        kv = keys.gather(2, idx), values.gather(2, idx)  # past each row's position: masked
        return kernels.attention(q, *kv, start_pos - first, self.spec.scale, **extra)

    def _chunk_pieces(self, q, keys, values, start: int, extra):
        """Queries at start.. (one int for the batch), cut at chunk boundaries: each piece
        attends over its chunk's keys up to its last query."""
        c, t = self.spec.chunk, q.shape[2]
        outs, a = [], start
        while a < start + t:
            first = a - a % c
            e = min(first + c, start + t)
            piece = q[:, :, a - start : e - start]
            kv = keys[:, :, first:e], values[:, :, first:e]
            outs.append(kernels.attention(piece, *kv, a - first, self.spec.scale, **extra))
            a = e
        return torch.cat(outs, dim=2)
