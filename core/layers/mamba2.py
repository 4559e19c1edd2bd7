"""Mamba2 (`Mamba2Spec`): the state-space mixer of Granite 4.0-H, Nemotron-H and Bamba.

Like gated DeltaNet, each row carries a fixed-size state instead of a per-token cache: the
causal conv's last K - 1 inputs (`conv`, (B, conv_dim, K - 1)) and the SSM state (`ssm`,
(B, H, head_dim, state_size) fp32), both in the static cache (core/kv_cache.py). A row whose
input starts at position 0 starts from zeros, so a reused row needs no reset.

Right-padded prefill (`lengths`): padded tokens get dt = 0, which leaves the SSM state as it
was (exp(0 A) = 1, nothing added), and the conv state keeps each row's last K - 1 *real*
inputs; so the padding never reaches a row's state.
"""

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from core.config_kinds import Mamba2Spec
from core.layers.causal_conv import causal_conv1d, real_tokens, zero_fresh_rows
from core.layers.linear import Linear


class Mamba2(nn.Module):
    def __init__(self, hidden: int, spec: Mamba2Spec, rope_interleaved: bool = False):
        super().__init__()
        self.spec = s = spec
        self.sizes = (s.intermediate, s.conv_dim, s.num_heads)  # the hub's z | xBC | dt
        self.in_proj = Linear(hidden, sum(self.sizes), bias=s.bias)
        # depthwise: one K-tap filter per channel of x | B | C (the hub's nn.Conv1d)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(s.conv_dim, 1, s.conv_kernel))
        self.conv1d.bias = nn.Parameter(torch.zeros(s.conv_dim)) if s.conv_bias else None
        self.dt_bias = nn.Parameter(torch.ones(s.num_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_heads))
        self.D = nn.Parameter(torch.ones(s.num_heads))
        if s.gated_norm != "none":
            self.norm = nn.Module()  # the gated, grouped RMSNorm (weight, not 1 + w)
            self.norm.weight = nn.Parameter(torch.ones(s.intermediate))
        out_bias = s.bias if s.out_bias is None else s.out_bias
        self.out_proj = Linear(s.intermediate, hidden, bias=out_bias)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, hidden)
        cos: None,  # no rope
        sin: None,
        conv_state: torch.Tensor,  # (B_max, conv_dim, K - 1), written in place
        ssm_state: torch.Tensor,  # (B_max, H, P, N) fp32, written in place
        start_pos: int | torch.Tensor,
        end: int,
        lengths: torch.Tensor | None = None,  # (B,) real tokens per row (right padding)
    ) -> torch.Tensor:
        s = self.spec
        bsz, t, _ = x.shape
        z, xbc, dt = self.in_proj(x).split(self.sizes, dim=-1)
        conv, ssm = conv_state[:bsz], ssm_state[:bsz]
        zero_fresh_rows(start_pos, conv, ssm)  # rows starting at position 0 start from zeros
        xbc = causal_conv1d(xbc, conv, self.conv1d.weight, self.conv1d.bias, lengths)
        gn = s.n_groups * s.state_size
        xs, bm, cm = xbc.to(x.dtype).split((s.intermediate, gn, gn), dim=-1)
        xs = xs.reshape(bsz, t, s.num_heads, s.head_dim)

        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*s.time_step_limit)
        real = real_tokens(lengths, t, x.device)
        if real is not None:  # padding: dt = 0 keeps the state as it is
            dt = dt * real[..., None]
        y = kernels.ssd_scan(
            xs,
            dt,
            -self.A_log.float().exp(),
            bm.reshape(bsz, t, s.n_groups, s.state_size),
            cm.reshape(bsz, t, s.n_groups, s.state_size),
            ssm,
            s.chunk_size,
        )
        y = y + self.D.float()[:, None] * xs.float()  # the D skip: (B, T, H, P)
        return self.out_proj(self._gated_norm(y.reshape(bsz, t, -1), z).to(x.dtype))

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm(y * silu(z)) over groups of `norm_group_size` channels, times the weight,
        in fp32 (spec.gated_norm "gate_first": mamba_ssm's norm_before_gate=False);
        RMSNorm(y) * silu(z) ("norm_first"), or y * silu(z) alone ("none")."""
        s, gate = self.spec, F.silu(z.float())
        if s.gated_norm == "none":
            return y.float() * gate
        h = y.float() * gate if s.gated_norm == "gate_first" else y.float()
        g = h.view(*h.shape[:-1], -1, s.norm_group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + s.norm_eps)
        g = self.norm.weight * g.view(h.shape)
        return g if s.gated_norm == "gate_first" else g * gate
