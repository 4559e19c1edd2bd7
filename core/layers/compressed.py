"""DeepSeek V4's attention (`CompressedAttentionSpec`): sliding-window MQA where key = value,
plus, on compressed layers, entries that each sum up a closed window of tokens.

Per layer, for the query at position p (rope: interleaved, on the LAST rope_dim dims):
- q = rope(rms(q_b(norm(q_a(x))))) per head (the second RMSNorm has no weight);
  kv = rope(norm(kv_proj(x))), one head shared by every query head, read as key and value;
- keys: the tokens in (p - sliding_window, p], and the compressed entries w with
  (w + 1) * rate <= p + 1 (window w closed by p): HCA all of them, CSA those the indexer picks;
- softmax over [scores | a learned sink per head], the weighted sum of values, then the rope
  rotation undone (at p) on the output's rope dims, since the values carried it;
- out = o_b(o_a per head group (o_groups blocks of o_lora_rank), flattened).
A compressed entry w (rate m): softmax over the window's m tokens (per channel) of
gate_proj(x) + position_bias, times kv_proj(x), summed; normed; roped at position w * m.
CSA's windows overlap: each token projects two series, and entry w sums window w - 1's
first series with window w's second (2m slots). The indexer builds its own entries so (at
index_head_dim), scores them sum_h w_h(x) * relu(q_h . k) and keeps the index_topk best.

Differs from transformers' implementation in bookkeeping only: the cache keeps every token's
projections and the entries are rebuilt each forward (transformers carries window buffers).
"""

import torch
import torch.nn.functional as F
from torch import nn

from core.config import RMSNormSpec, RopeSpec
from core.config_kinds import CompressedAttentionSpec
from core.kv_cache import as_compute, cache_write
from core.layers.hyper import unweighted_rms_norm
from core.layers.linear import Linear
from core.layers.norm import RMSNorm
from core.layers.rope import attention_factor, cos_sin, inv_freq

CHUNK = 256  # queries per attention pass: bounds the scores' memory on long prompts


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rope on the last 2 * cos.shape[-1] dims of x, in fp32 (cos, sin broadcast
    to x's leading dims, rounded to x's dtype first as transformers' tables are)."""
    rd = 2 * cos.shape[-1]
    cos = cos.to(x.dtype).repeat_interleave(2, dim=-1)
    sin = sin.to(x.dtype).repeat_interleave(2, dim=-1)
    keep, rot = x[..., :-rd], x[..., -rd:]
    turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rot.float() * cos + turned.float() * sin).to(x.dtype)
    return torch.cat([keep, rotated], dim=-1)


def rope_at(spec: RopeSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (len(positions), dim/2) of `spec` at any positions (the entries' w * rate)."""
    cos, sin = cos_sin(inv_freq(spec).to(positions.device), positions)
    f = attention_factor(spec)
    return (cos * f, sin * f) if f != 1.0 else (cos, sin)


class Compressor(nn.Module):
    """Projections per token -> compressed entries (B, W, dim), one per closed window."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: int, eps: float):
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = Linear(hidden, overlap * dim, bias=False)
        self.gate_proj = Linear(hidden, overlap * dim, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, overlap * dim))
        self.position_bias.keep_fp32 = True
        self.kv_norm = RMSNorm(dim, RMSNormSpec(eps, fp32_weight=True))

    def cached(self, x, kv_cache, gate_cache, start_pos, end, like):
        """Store x's projections; every cached one up to `end`, (B, end, overlap * dim) each."""
        kv = cache_write(kv_cache, self.kv_proj(x), start_pos, end, seq_dim=1)
        gate = cache_write(gate_cache, self.gate_proj(x), start_pos, end, seq_dim=1)
        return as_compute(kv, like), as_compute(gate, like)

    def entries(self, kv: torch.Tensor, gate: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
        b, n, _ = kv.shape
        r, d = self.rate, self.dim
        w = n // r
        width = kv.shape[-1]  # overlap * dim
        kv = kv[:, : w * r].view(b, w, r, width)
        gate = gate[:, : w * r].view(b, w, r, width) + self.position_bias  # fp32
        if self.overlap == 2:  # CSA: [window w - 1's first series | window w's second]
            prev_kv, prev_gate = kv.new_zeros(b, w, r, d), gate.new_full((b, w, r, d), -torch.inf)
            prev_kv[:, 1:], prev_gate[:, 1:] = kv[:, :-1, :, :d], gate[:, :-1, :, :d]
            kv = torch.cat([prev_kv, kv[..., d:]], dim=2)
            gate = torch.cat([prev_gate, gate[..., d:]], dim=2)
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        out = self.kv_norm((kv * weights).sum(dim=2))  # (B, W, dim)
        cos, sin = rope_at(rope, torch.arange(w, device=kv.device) * r)
        return rope_tail(out, cos, sin)


class IndexScorer(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.weights_proj = Linear(hidden, heads, bias=False)


class Indexer(Compressor):
    """CSA's lightning indexer: its own (overlapping) compressed keys, its own queries."""

    def __init__(self, hidden: int, spec: CompressedAttentionSpec):
        super().__init__(hidden, spec.index_head_dim, spec.compress_rate, 2, spec.norm_eps)
        self.spec = spec
        self.q_b_proj = Linear(spec.q_lora_rank, spec.index_heads * spec.index_head_dim, False)
        self.scorer = IndexScorer(hidden, spec.index_heads)

    def keys(self, x, caches, start_pos, end) -> torch.Tensor:
        """Store x's projections; the indexer's compressed keys (B, W, Di)."""
        return self.entries(*self.cached(x, *caches, start_pos, end, x), self.spec.rope)

    def pick(self, x, q_lora, cos, sin, keys, allowed):
        """(B, T, W) bool: the index_topk entries of `allowed` that score best per query."""
        s, (b, t, _) = self.spec, x.shape
        if keys.shape[1] == 0:
            return allowed
        q = self.q_b_proj(q_lora).view(b, t, s.index_heads, s.index_head_dim)
        q = rope_tail(q, cos[:, :, None], sin[:, :, None])
        scores = F.relu(torch.einsum("bthd,bsd->bths", q.float(), keys.float()))
        scores = scores * s.index_head_dim**-0.5
        weights = self.scorer.weights_proj(x).float() * s.index_heads**-0.5  # (B, T, Hi)
        score = (scores * weights[..., None]).sum(dim=2).masked_fill(~allowed, -torch.inf)
        top = score.topk(min(s.index_topk, score.shape[-1]), dim=-1).indices
        return allowed & torch.zeros_like(allowed).scatter(-1, top, True)


class GroupedLinear(nn.Module):
    """o_groups independent maps: (..., G, in) -> (..., G, out); weight (G * out, in)."""

    def __init__(self, groups: int, in_features: int, out_features: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])  # (G, out, in)
        return torch.einsum("...gi,goi->...go", x, w)


class CompressedAttention(nn.Module):
    def __init__(self, hidden: int, spec: CompressedAttentionSpec, rope_interleaved: bool = True):
        # (rope_interleaved: always true here; rope_tail rotates pairs of the heads' last dims)
        super().__init__()
        self.spec = spec
        h, d, norm = spec.num_heads, spec.head_dim, RMSNormSpec(spec.norm_eps, fp32_weight=True)
        self.q_a_proj = Linear(hidden, spec.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(spec.q_lora_rank, norm)
        self.q_b_proj = Linear(spec.q_lora_rank, h * d, bias=False)
        self.kv_proj = Linear(hidden, d, bias=False)
        self.kv_norm = RMSNorm(d, norm)
        self.o_a_proj = GroupedLinear(spec.o_groups, h * d // spec.o_groups, spec.o_lora_rank)
        self.o_b_proj = Linear(spec.o_groups * spec.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h))
        self.sinks.keep_fp32 = True
        self.n_cached = len(spec.cache_layout(1, 1))
        if spec.compress_rate:
            self.compressor = Compressor(hidden, d, spec.compress_rate, spec.overlap, norm.eps)
            if spec.index_heads:
                self.compressor.indexer = Indexer(hidden, spec)

    def forward(self, x, cos, sin, *args):
        """x (B, T, hidden); cos, sin (1 or B, T, rope_dim/2) of this layer's rope; then its
        cache tensors (kv[, ckv, cgate[, ikv, igate]]), start_pos, end[, lengths]."""
        caches, (start_pos, end) = args[: self.n_cached], args[self.n_cached :][:2]
        s, (b, t, _) = self.spec, x.shape
        q_lora = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_lora).view(b, t, s.num_heads, s.head_dim)
        q = rope_tail(unweighted_rms_norm(q, s.norm_eps), cos[:, :, None], sin[:, :, None])
        kv = rope_tail(self.kv_norm(self.kv_proj(x)), cos, sin)  # (B, T, D)
        keys = as_compute(cache_write(caches[0], kv, start_pos, end, seq_dim=1), q)
        entries = index_keys = None
        if s.compress_rate:
            c = self.compressor
            entries = c.entries(*c.cached(x, *caches[1:3], start_pos, end, q), s.rope)
            if s.index_heads:
                index_keys = c.indexer.keys(x, caches[3:5], start_pos, end)
        pos = _positions(start_pos, b, t, x.device)
        outs = []
        for i in range(0, t, CHUNK):  # queries by chunks: scores (B, H, CHUNK, window + ...)
            part = slice(i, i + CHUNK)
            near, visible = _band(keys, pos[:, part], s.sliding_window)
            if entries is not None:
                closed = torch.arange(entries.shape[1], device=x.device)
                closed = closed < (pos[:, part, None] + 1) // s.compress_rate  # (B, C, W)
                if index_keys is not None:
                    query = (x[:, part], q_lora[:, part], cos[:, part], sin[:, part])
                    closed = self.compressor.indexer.pick(*query, index_keys, closed)
                near = torch.cat([near, entries], dim=1)
                visible = torch.cat([visible, closed], dim=-1)
            outs.append(self._attend(q[:, part], near, visible))
        o = rope_tail(torch.cat(outs, dim=1), cos[:, :, None], -sin[:, :, None])  # undo V's rope
        o = self.o_a_proj(o.reshape(b, t, s.o_groups, -1)).flatten(2)
        return self.o_b_proj(o)

    def _attend(self, q, keys, visible):
        """q (B, T, H, D) over keys = values (B, S, D) where visible (B, T, S); with sinks."""
        b, t, h, _ = q.shape
        scores = torch.einsum("bthd,bsd->bhts", q.float(), keys.float()) * self.spec.head_dim**-0.5
        scores = scores.masked_fill(~visible[:, None], -torch.inf)
        sinks = self.sinks.float().view(1, h, 1, 1).expand(b, h, t, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("bhts,bsd->bthd", probs, keys.float()).to(q.dtype)


def _band(keys: torch.Tensor, pos: torch.Tensor, window: int):
    """The keys queries at `pos` (B, C) can see in the window, gathered per row: those at
    first - window + 1 .. last position, (B, C + window - 1, D), and which query sees which
    (B, C, C + window - 1). Positions before 0 or past a query are masked."""
    at = pos[:, :1] - window + 1 + torch.arange(pos.shape[1] + window - 1, device=pos.device)
    index = at.clamp(0, keys.shape[1] - 1)[..., None].expand(-1, -1, keys.shape[-1])
    near = keys.gather(1, index)
    at, pos = at[:, None, :], pos[..., None]
    return near, (at >= 0) & (at <= pos) & (at > pos - window)


def _positions(start_pos, b: int, t: int, device) -> torch.Tensor:
    """(B, T) positions of the queries."""
    steps = torch.arange(t, device=device)
    if torch.is_tensor(start_pos):
        return start_pos.to(device)[:, None] + steps
    return (start_pos + steps)[None].expand(b, t)
