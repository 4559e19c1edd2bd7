"""Rotary position embeddings: inverse frequencies per rope kind, and the cos/sin table.

Frequencies and tables are built in fp32 with the same operations as transformers, so the
angles agree to the last bit; `kernels.apply_rope` rotates q and k with them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from core.config import (
    DefaultRope,
    DynamicRope,
    LinearRope,
    Llama3Rope,
    LongRope,
    ProportionalRope,
    RopeSpec,
    YarnRope,
)


def _base_inv_freq(theta: float | torch.Tensor, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inv_freq(spec: RopeSpec, seq_len: int | None = None) -> torch.Tensor:
    """(dim/2,) fp32 inverse frequencies. `seq_len` matters only to dynamic NTK scaling and
    to LongRoPE (its long factors past original_max_position_embeddings)."""
    if isinstance(spec, LinearRope):
        return _base_inv_freq(spec.theta, spec.dim) / spec.factor
    if isinstance(spec, DynamicRope):
        # Same fp32 tensor arithmetic as transformers, which receives seq_len as a tensor.
        mpe = spec.max_position_embeddings
        if seq_len is None or seq_len <= mpe:
            return _base_inv_freq(spec.theta, spec.dim)
        seq = torch.tensor(seq_len)
        f, d = spec.factor, spec.dim
        theta = spec.theta * ((f * seq / mpe) - (f - 1)) ** (d / (d - 2))
        return _base_inv_freq(theta, d)
    if isinstance(spec, Llama3Rope):
        return _llama3_inv_freq(spec)
    if isinstance(spec, YarnRope):
        return _yarn_inv_freq(spec)
    if isinstance(spec, LongRope):  # transformers' _compute_longrope_parameters' expression
        long = seq_len is not None and seq_len > spec.original_max_position_embeddings
        ext = torch.tensor(spec.long_factor if long else spec.short_factor, dtype=torch.float32)
        shape = torch.arange(0, spec.dim, 2, dtype=torch.int64).float() / spec.dim
        return 1.0 / (ext * spec.theta**shape)
    if isinstance(spec, ProportionalRope):  # the first `rotated` frequencies; the rest 0
        inv = _base_inv_freq(spec.theta, spec.dim)
        return torch.cat((inv[: spec.rotated], torch.zeros(spec.dim // 2 - spec.rotated)))
    if type(spec) is DefaultRope:
        return _base_inv_freq(spec.theta, spec.dim)
    raise TypeError(f"no inverse frequencies for rope spec {type(spec).__name__}")


def _llama3_inv_freq(spec: Llama3Rope) -> torch.Tensor:
    inv = _base_inv_freq(spec.theta, spec.dim)
    old = spec.original_max_position_embeddings
    low_wavelen = old / spec.low_freq_factor  # longer waves than this are divided by factor
    high_wavelen = old / spec.high_freq_factor  # shorter waves than this stay as they are
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / spec.factor, inv)
    smooth = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(spec: YarnRope) -> torch.Tensor:
    """transformers' `_compute_yarn_parameters`, expression for expression (bit-identical)."""
    dim, base, old = spec.dim, spec.theta, spec.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times in `old`
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (spec.factor * pos_freqs)
    keep = 1 - ramp  # 1: high frequencies kept as they are; 0: low ones divided by factor
    return interpolation * (1 - keep) + extrapolation * keep


def attention_factor(spec: RopeSpec) -> float:
    """The factor cos and sin are multiplied by (YaRN's and LongRoPE's temperature); 1 for the
    other kinds."""
    return spec.attention_factor if isinstance(spec, YarnRope | LongRope) else 1.0


def cos_sin(inv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (len(positions), dim/2) tables of cos and sin of position * inv_freq."""
    freqs = positions.float()[:, None] * inv[None, :]
    return freqs.cos(), freqs.sin()


def _table(spec: RopeSpec, max_seq_len: int, seq_len: int | None = None):
    cos, sin = cos_sin(inv_freq(spec, seq_len), torch.arange(max_seq_len))
    if attention_factor(spec) != 1.0:  # fp32 product, as transformers scales its table
        cos, sin = cos * attention_factor(spec), sin * attention_factor(spec)
    return cos, sin


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table for positions [0, max_seq_len); slices it per forward.
    LongRoPE holds a second table, of its long factors (`cos_long`, `sin_long`)."""

    def __init__(self, spec: RopeSpec, max_seq_len: int, device: torch.device | str):
        super().__init__()
        self.spec = spec
        cos, sin = _table(spec, max_seq_len)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)
        if isinstance(spec, LongRope):
            cos, sin = _table(spec, max_seq_len, spec.original_max_position_embeddings + 1)
            self.register_buffer("cos_long", cos.to(device), persistent=False)
            self.register_buffer("sin_long", sin.to(device), persistent=False)

    def forward(
        self,
        start_pos: int | torch.Tensor,
        length: int,
        end: int,
        lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions start_pos .. start_pos+length-1: (1, length, dim/2) for an int
        start_pos, (B, length, dim/2) for per-row (B,) positions. `end` is the largest position
        + 1 in the batch; `lengths`, (B,) real tokens per right-padded row, matters only to
        LongRoPE (which picks its table by each row's last real position)."""
        spec = self.spec
        per_row = isinstance(start_pos, torch.Tensor)
        if isinstance(spec, DynamicRope) and end > spec.max_position_embeddings:
            # Dynamic NTK: frequencies depend on the current length (the batch's longest, as in
            # transformers), so the table does not apply.
            pos = (start_pos.cpu()[:, None] if per_row else start_pos) + torch.arange(length)
            cos, sin = cos_sin(inv_freq(spec, end), pos.flatten())
            shape = (-1, length, cos.shape[-1])
            return cos.to(self.cos.device).view(shape), sin.to(self.sin.device).view(shape)
        if isinstance(spec, LongRope):
            return self._longrope(start_pos, length, lengths)
        if per_row:
            pos = start_pos[:, None] + torch.arange(length, device=start_pos.device)
            return self.cos[pos], self.sin[pos]
        stop = start_pos + length
        return self.cos[None, start_pos:stop], self.sin[None, start_pos:stop]

    def _longrope(self, start_pos, length: int, lengths: torch.Tensor | None):
        """The short or the long table, by the last real position of the call (per row), as
        transformers picks for a sequence alone: long once max(position) + 1 > original."""
        old = self.spec.original_max_position_embeddings
        if not isinstance(start_pos, torch.Tensor) and lengths is None:
            stop = start_pos + length
            cos, sin = (self.cos_long, self.sin_long) if stop > old else (self.cos, self.sin)
            return cos[None, start_pos:stop], sin[None, start_pos:stop]
        dev = self.cos.device
        start = torch.as_tensor(start_pos, device=dev).reshape(-1)  # (B,) or (1,)
        pos = start[:, None] + torch.arange(length, device=dev)  # (B or 1, T)
        stop = start + (lengths.to(dev) if lengths is not None else length)
        long = (stop > old)[:, None, None]  # (B, 1, 1): no host sync
        cos = torch.where(long, self.cos_long[pos], self.cos[pos])
        return cos, torch.where(long, self.sin_long[pos], self.sin[pos])
