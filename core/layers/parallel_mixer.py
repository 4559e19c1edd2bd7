"""Attention and Mamba2 in parallel (`ParallelMixerSpec`, Falcon-H1): both read the block's
normed input and their outputs are summed, out = attn(x) + mamba(x).

The two are the core's own modules (GQAAttention, Mamba2), each on its own cache tensors:
the attention's keys and values, then Mamba2's conv window and SSM state, in the order the
spec's `cache_layout` names them. Falcon-H1's multipliers around the two (input, key and
output scales, the ssm_multipliers over in_proj's z | x | B | C | dt rows) are folded into
their weights at load (the plugin's `weight_scales`), so nothing here scales at run time.
"""

import torch
from torch import nn

from core.config_kinds import ParallelMixerSpec
from core.layers.attention import GQAAttention
from core.layers.mamba2 import Mamba2


class ParallelMixer(nn.Module):
    def __init__(self, hidden: int, spec: ParallelMixerSpec, rope_interleaved: bool = False):
        super().__init__()
        self.spec = spec
        self.attn = GQAAttention(hidden, spec.attention, rope_interleaved)
        self.mamba = Mamba2(hidden, spec.mamba)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, hidden), the block's normed input
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        k_cache: torch.Tensor,  # the attention's (GQAAttention.forward)
        v_cache: torch.Tensor,
        conv_state: torch.Tensor,  # Mamba2's (Mamba2.forward)
        ssm_state: torch.Tensor,
        start_pos: int | torch.Tensor,
        end: int,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        a = self.attn(x, cos, sin, k_cache, v_cache, start_pos, end, lengths)
        m = self.mamba(x, None, None, conv_state, ssm_state, start_pos, end, lengths)
        return a + m
