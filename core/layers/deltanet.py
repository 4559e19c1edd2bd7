"""Gated DeltaNet (`GatedDeltaNetSpec`): the linear-attention layer of Qwen3-Next and Qwen3.5.

Instead of a cache that grows per token, each row carries a fixed-size state: the causal conv's
last K - 1 inputs (`conv`, (B, conv_dim, K - 1)) and the delta rule's (`state`, (B, Hv, Dk,
Dv) fp32), both in the static cache (core/kv_cache.py). A row whose input starts at position 0
starts from zeros, so a reused row (a new generation, a server slot) needs no reset.

Right-padded prefill (`lengths`): padded tokens get g = beta = 0, which leaves the delta-rule
state as it was, and the conv state keeps each row's last K - 1 *real* inputs; so the padding
never reaches a row's state.
"""

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from core.config_kinds import GatedDeltaNetSpec
from core.layers.causal_conv import causal_conv1d, real_tokens, zero_fresh_rows
from core.layers.linear import FusedLinear, Linear


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (as fla and transformers)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, spec: GatedDeltaNetSpec, rope_interleaved: bool = False):
        super().__init__()
        self.spec = s = spec
        kd, vd, hv = s.key_dim, s.value_dim, s.num_v_heads
        if s.layout == "grouped":  # Qwen3-Next: rows grouped per key head, un-grouped below
            parts = {"qkvz": 2 * kd + 2 * vd, "ba": 2 * hv}
        else:  # Qwen3.5: in_proj_qkv | in_proj_z | in_proj_b | in_proj_a
            parts = {"qkv": 2 * kd + vd, "z": vd, "b": hv, "a": hv}
        self.in_proj = FusedLinear(hidden, parts)
        self.sizes = tuple(parts.values())
        # depthwise: one K-tap filter per channel of q | k | v (the hub's nn.Conv1d weight)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(s.conv_dim, 1, s.conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = nn.Module()  # the gated RMSNorm over each value head (weight, not 1 + w)
        self.norm.weight = nn.Parameter(torch.ones(s.head_v_dim))
        self.out_proj = Linear(vd, hidden, bias=False)

    def _split(self, x: torch.Tensor):
        """in_proj -> (q|k|v (B, T, conv_dim), z (B, T, Hv, Dv), b, a (B, T, Hv))."""
        s = self.spec
        b_, t = x.shape[:2]
        parts = self.in_proj(x).split(self.sizes, dim=-1)
        if s.layout == "flat":
            qkv, z, b, a = parts
            return qkv, z.reshape(b_, t, s.num_v_heads, s.head_v_dim), b, a
        # grouped per key head: [q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)] and [b (r) | a (r)]
        nk, dk, r = s.num_k_heads, s.head_k_dim, s.num_v_heads // s.num_k_heads
        qkvz, ba = parts
        q, k, v, z = qkvz.view(b_, t, nk, -1).split(
            (dk, dk, r * s.head_v_dim, r * s.head_v_dim), -1
        )
        b, a = ba.view(b_, t, nk, 2 * r).split((r, r), -1)
        qkv = torch.cat([p.reshape(b_, t, -1) for p in (q, k, v)], dim=-1)
        z = z.reshape(b_, t, s.num_v_heads, s.head_v_dim)
        return qkv, z, b.reshape(b_, t, -1), a.reshape(b_, t, -1)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, hidden)
        cos: None,  # no rope
        sin: None,
        conv_state: torch.Tensor,  # (B_max, conv_dim, K - 1), written in place
        state: torch.Tensor,  # (B_max, Hv, Dk, Dv) fp32, written in place
        start_pos: int | torch.Tensor,
        end: int,
        lengths: torch.Tensor | None = None,  # (B,) real tokens per row (right padding)
    ) -> torch.Tensor:
        s = self.spec
        bsz, t, _ = x.shape
        qkv, z, b, a = self._split(x)
        conv, st = conv_state[:bsz], state[:bsz]
        zero_fresh_rows(start_pos, conv, st)  # rows starting at position 0 start from zeros
        mixed = causal_conv1d(qkv, conv, self.conv1d.weight, None, lengths)

        q, k, v = mixed.to(x.dtype).split((s.key_dim, s.key_dim, s.value_dim), dim=-1)
        q = l2norm(q.reshape(bsz, t, s.num_k_heads, s.head_k_dim))
        k = l2norm(k.reshape(bsz, t, s.num_k_heads, s.head_k_dim))
        v = v.reshape(bsz, t, s.num_v_heads, s.head_v_dim)
        beta = b.float().sigmoid()  # (B, T, Hv)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        real = real_tokens(lengths, t, x.device)
        if real is not None:  # padding: g = beta = 0 keeps the state as it is
            beta, g = beta * real[..., None], g * real[..., None]
        o = kernels.gated_delta_rule(q, k, v, g, beta, st, s.head_k_dim**-0.5).to(x.dtype)

        # gated RMSNorm per value head: rms_norm(o) * w * silu(z), then back to x's dtype
        o = kernels.rms_norm(o, self.norm.weight, s.norm_eps)
        o = (o.float() * F.silu(z.float())).to(x.dtype)
        return self.out_proj(o.reshape(bsz, t, s.value_dim))
