"""Gated short convolution (`ShortConvSpec`): the conv layers of LFM2.

in_proj gives three hidden-wide parts B, C, x; y = C * conv(B * x), where the conv is causal
and depthwise (`l_cache` taps per channel) over [the row's last L - 1 inputs | the new ones];
then out_proj. The row's state is those last L - 1 inputs of the conv (`conv`, (B, hidden,
L - 1)) in the static cache (core/kv_cache.py). A row whose input starts at position 0 starts
from zeros, so a reused row needs no reset; under right padding (`lengths`) the state keeps
each row's last L - 1 *real* inputs, so the padding never reaches it.

`causal_conv` is the conv-with-state step on its own, one function, as gated DeltaNet's
(core/layers/deltanet.py) conv is the same step followed by a SiLU.
"""

import torch
import torch.nn.functional as F
from torch import nn

from core.config_kinds import ShortConvSpec
from core.layers.linear import Linear


def fresh_rows(start_pos: int | torch.Tensor, b: int, device) -> torch.Tensor | None:
    """Rows whose input starts at position 0 (their state starts from zeros); None: no row
    (an int start_pos > 0)."""
    if isinstance(start_pos, int):
        return torch.ones(b, dtype=torch.bool, device=device) if start_pos == 0 else None
    return start_pos.to(device).view(b) == 0


def causal_conv(
    state: torch.Tensor,  # (B, C, K - 1): each row's last inputs, written in place
    x: torch.Tensor,  # (B, C, T): the new inputs
    weight: torch.Tensor,  # (C, 1, K): one K-tap filter per channel
    bias: torch.Tensor | None,  # (C,) or None
    lengths: torch.Tensor | None = None,  # (B,) real inputs per row (right padding)
) -> torch.Tensor:
    """The causal depthwise conv of x after each row's state -> (B, C, T) in weight's dtype;
    the state then holds the K - 1 inputs before each row's end (its real length)."""
    seq = torch.cat((state, x.to(state.dtype)), dim=-1)  # (B, C, K - 1 + T)
    out = F.conv1d(seq.to(weight.dtype), weight, bias, groups=weight.shape[0])
    k1, t = state.shape[-1], x.shape[-1]
    if lengths is None:
        state.copy_(seq[:, :, t:])
    else:  # seq[:, :, L : L + K - 1] per row
        idx = lengths.to(seq.device).view(-1, 1, 1) + torch.arange(k1, device=seq.device)
        state.copy_(seq.gather(2, idx.expand(-1, seq.shape[1], -1)))
    return out


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
        fresh = fresh_rows(start_pos, bsz, x.device)
        if fresh is not None:
            state.masked_fill_(fresh[:, None, None], 0)
        y = causal_conv(state, (b * h).transpose(1, 2), self.conv.weight, self.conv.bias, lengths)
        return self.out_proj(c * y.transpose(1, 2).to(x.dtype))
