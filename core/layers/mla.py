"""Multi-head latent attention (DeepSeek V2/V3) over a compressed cache.

Each token caches only its normed latent c (kv_lora_rank) and its roped key part k_pe
(qk_rope_head_dim), shared by all heads. kv_b_proj would expand c into per-head k_nope and v;
instead its two halves are absorbed into the query and the output (as vLLM and mlx-lm do):

    q_nope . (W_uk c) = (q_nope W_uk) . c        out = W_uv (softmax(...) @ c)

so prefill and decode both attend over the latent directly, and nothing per-head is cached.
Parameter names are the hub's, so the weight map is the identity here.
"""

import torch
from torch import nn

import kernels
from core.config import MLASpec, RMSNormSpec
from core.kv_cache import as_compute, cache_write
from core.layers.linear import Linear
from core.layers.norm import RMSNorm


class MLAAttention(nn.Module):
    def __init__(self, hidden: int, spec: MLASpec, rope_interleaved: bool = True):
        super().__init__()
        self.spec = spec
        self.interleaved = rope_interleaved
        h, r = spec.num_heads, spec.kv_lora_rank
        if spec.q_lora_rank is None:
            self.q_proj = Linear(hidden, h * spec.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, spec.q_lora_rank, bias=spec.bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, RMSNormSpec(spec.norm_eps))
            self.q_b_proj = Linear(spec.q_lora_rank, h * spec.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, r + spec.qk_rope_head_dim, bias=spec.bias)
        self.kv_a_layernorm = RMSNorm(r, RMSNormSpec(spec.norm_eps))
        self.kv_b_proj = Linear(r, h * (spec.qk_nope_head_dim + spec.v_head_dim), bias=False)
        self.kv_b_proj.quantizable = False  # read as a matrix (absorbed into q and o), not run
        self.o_proj = Linear(h * spec.v_head_dim, hidden, bias=spec.bias)

    def _query_input(self, x: torch.Tensor) -> torch.Tensor:
        """What q is projected from: x, or its normed low-rank q_a (which DSA's indexer reads)."""
        if self.spec.q_lora_rank is None:
            return x
        return self.q_a_layernorm(self.q_a_proj(x))

    def _query(self, q_in: torch.Tensor) -> torch.Tensor:
        return self.q_proj(q_in) if self.spec.q_lora_rank is None else self.q_b_proj(q_in)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head into W_uk (H, D_nope, R) and W_uv (H, D_v, R)."""
        s = self.spec
        w = self.kv_b_proj.weight.view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, -1)
        return w[:, : s.qk_nope_head_dim], w[:, s.qk_nope_head_dim :]

    def forward(
        self,
        x: torch.Tensor,  # (B, T, hidden)
        cos: torch.Tensor,  # (1, T, rope/2) fp32
        sin: torch.Tensor,
        latent_cache: torch.Tensor,  # (B_max, S_max, R), written in place
        k_pe_cache: torch.Tensor,  # (B_max, S_max, D_rope), written in place
        start_pos: int | torch.Tensor,  # an int, or (B,) per-row positions
        end: int,  # max(start_pos) + T: how much of the cache attention reads
        lengths: torch.Tensor | None = None,  # real tokens per row: a full cache needs none
    ) -> torch.Tensor:
        q_lat, q_pe, latents, k_pes = self._attention_inputs(
            x, self._query_input(x), cos, sin, latent_cache, k_pe_cache, start_pos, end
        )
        o_lat = kernels.mla_attention(q_lat, q_pe, latents, k_pes, start_pos, self.spec.scale)
        return self._output(o_lat)

    def _attention_inputs(self, x, q_in, cos, sin, latent_cache, k_pe_cache, start_pos, end):
        """(q_lat, q_pe, latents, k_pes): the absorbed query, its roped part, and the cache up
        to `end` with this step's latents and k_pe written in."""
        b, t, _ = x.shape
        s = self.spec
        q = self._query(q_in).view(b, t, s.num_heads, s.qk_head_dim).transpose(1, 2)
        q_nope, q_pe = q.split((s.qk_nope_head_dim, s.qk_rope_head_dim), dim=-1)  # (B, H, T, .)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split((s.kv_lora_rank, s.qk_rope_head_dim), -1)
        latent = self.kv_a_layernorm(latent)  # (B, T, R)
        q_pe, k_pe = kernels.apply_rope(q_pe, k_pe[:, None], cos, sin, self.interleaved)
        latents = as_compute(cache_write(latent_cache, latent, start_pos, end, seq_dim=1), x)
        k_pes = as_compute(cache_write(k_pe_cache, k_pe[:, 0], start_pos, end, seq_dim=1), x)
        w_uk, _ = self._absorbed()
        q_lat = torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk)  # (B, H, T, R)
        return q_lat, q_pe, latents, k_pes

    def _output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """(B, H, T, R) attention over the latents -> (B, T, hidden), through W_uv and o_proj."""
        b, h, t, _ = o_lat.shape
        _, w_uv = self._absorbed()
        o = torch.einsum("bhtr,hvr->bthv", o_lat, w_uv)  # (B, T, H, D_v)
        return self.o_proj(o.reshape(b, t, h * self.spec.v_head_dim))
