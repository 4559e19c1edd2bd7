"""Gated short convolution (`ShortConvSpec`): the conv layers of LFM2.

in_proj gives three hidden-wide parts B, C, x; y = C * conv(B * x), where the conv is causal
and depthwise (`l_cache` taps per channel) over [the row's last L - 1 inputs | the new ones];
then out_proj. The row's state is those last L - 1 inputs of the conv (`conv`, (B, hidden,
L - 1)) in the static cache (core/kv_cache.py). A row whose input starts at position 0 starts
from zeros, so a reused row needs no reset; under right padding (`lengths`) the state keeps
each row's last L - 1 *real* inputs, so the padding never reaches it.

The conv with its state is core/layers/causal_conv.py's, shared with gated DeltaNet and Mamba2
(which follow it with a SiLU).
"""

import torch
from torch import nn

from core.config_kinds import ShortConvSpec
from core.layers.causal_conv import causal_conv1d, zero_fresh_rows
from core.layers.linear import Linear


class ShortConv(nn.Module):
    def __init__(self, hidden: int, spec: ShortConvSpec, rope_interleaved: bool = False):
        super().__init__()
        self.spec = spec
        self.in_proj = Linear(hidden, 3 * hidden, bias=spec.bias)  # rows B | C | x
        # depthwise: one L-tap filter per channel (the hub's nn.Conv1d weight and bias)
        self.conv = nn.Module()
        self.conv.weight = nn.Parameter(torch.empty(hidden, 1, spec.l_cache))
        self.conv.bias = nn.Parameter(torch.zeros(hidden)) if spec.bias else None
        self.out_proj = Linear(hidden, hidden, bias=spec.bias)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, hidden)
        cos: None,  # no rope
        sin: None,
        conv_state: torch.Tensor,  # (B_max, hidden, L - 1), written in place
        start_pos: int | torch.Tensor,
        end: int,
        lengths: torch.Tensor | None = None,  # (B,) real tokens per row (right padding)
    ) -> torch.Tensor:
        bsz = x.shape[0]
        b, c, h = self.in_proj(x).chunk(3, dim=-1)  # (B, T, hidden) each
        state = conv_state[:bsz]
        zero_fresh_rows(start_pos, state)
        w, bias = self.conv.weight, self.conv.bias
        y = causal_conv1d(b * h, state, w, bias, lengths, silu=False)  # (B, T, hidden)
        return self.out_proj(c * y.to(x.dtype))
