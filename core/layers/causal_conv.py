"""The causal depthwise conv with a per-row state that the recurrent layers share (gated
DeltaNet, Mamba2, LFM2's short conv), and the row bookkeeping around their fixed-size states.

Each row's conv state holds its last K - 1 inputs (B, C, K - 1); the conv runs over [that
state | the new inputs], so a prompt fed in chunks gives the same outputs as one pass. Under
right padding (`lengths`) the state keeps each row's last K - 1 *real* inputs.
"""

import torch
import torch.nn.functional as F


def zero_fresh_rows(start_pos: int | torch.Tensor, *states: torch.Tensor) -> None:
    """Zero the states (B, ...) of the rows whose input starts at position 0, so a reused row
    (a new generation, a server slot) needs no reset; an int start_pos > 0 touches nothing."""
    b = states[0].shape[0]
    if isinstance(start_pos, int):
        if start_pos == 0:
            for st in states:
                st.zero_()
        return
    fresh = start_pos.to(states[0].device).view(b) == 0
    for st in states:
        st.masked_fill_(fresh.view(b, *[1] * (st.dim() - 1)), 0)


def real_tokens(lengths: torch.Tensor | None, t: int, device) -> torch.Tensor | None:
    """(B, T) bool: the tokens before each row's length (right padding); None without it."""
    if lengths is None:
        return None
    return torch.arange(t, device=device)[None] < lengths.to(device)[:, None]


def causal_conv1d(
    x: torch.Tensor,  # (B, T, C)
    conv: torch.Tensor,  # (B, C, K - 1): the row's last inputs, written in place
    weight: torch.Tensor,  # (C, 1, K): the hub's depthwise nn.Conv1d weight
    bias: torch.Tensor | None,
    lengths: torch.Tensor | None = None,  # (B,) real tokens per row (right padding)
    silu: bool = True,  # False: the conv alone (LFM2's short conv)
) -> torch.Tensor:
    """SiLU(depthwise causal conv of x after the row's state) -> (B, T, C) in weight's dtype;
    the state then holds the K - 1 inputs before each row's end."""
    t = x.shape[1]
    seq = torch.cat((conv, x.transpose(1, 2).to(conv.dtype)), dim=-1)  # (B, C, K-1+T)
    out = F.conv1d(seq.to(weight.dtype), weight, bias, groups=weight.shape[0])
    out = F.silu(out) if silu else out
    _keep_inputs(conv, seq, t, lengths)
    return out.transpose(1, 2)


def _keep_inputs(conv, seq, t: int, lengths) -> None:
    """The conv state after this input: the K - 1 inputs before each row's end (its real
    length under right padding), i.e. seq[:, :, L : L + K - 1]."""
    k1 = conv.shape[-1]
    if lengths is None:
        conv.copy_(seq[:, :, t:])
        return
    idx = lengths.to(seq.device).view(-1, 1, 1) + torch.arange(k1, device=seq.device)
    conv.copy_(seq.gather(2, idx.expand(-1, seq.shape[1], -1)))
