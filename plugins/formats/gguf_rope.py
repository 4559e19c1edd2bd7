"""Rope and row-order helpers of the GGUF reader (gguf.py): llama.cpp's q/k row order
undone, the roped share of a head, and Llama 3's rope scaling recovered from `rope_freqs`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.errors import ConfigError
from plugins.formats.gguf_archs import ROPE_FREQS

if TYPE_CHECKING:
    import torch


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `LlamaModel.permute`: each head's rows were reordered from the hub's
    (2 halves, d/2) rotary layout to interleaved pairs (d/2, 2); swap them back."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def rotary_factor(rope_dim: int, cfg: dict[str, Any]) -> float:
    """partial_rotary_factor of `rope_dim` roped dims per head: the hub's factor f gives
    int(head_dim * f) of them, so the smallest f that gives `rope_dim` (1.0: all)."""
    heads = cfg.get("num_attention_heads") or 1  # missing fields fail validation later
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 0) // heads
    if not head_dim or rope_dim >= head_dim:
        return 1.0
    f = rope_dim / head_dim
    while int(head_dim * f) < rope_dim:  # a quotient a rounding below (1 / 49 * 49 < 1)
        f = math.nextafter(f, 1.0)
    return f


def llama3_rope_scaling(
    factors: np.ndarray, theta: float, dim: int, path: Path
) -> dict[str, Any] | None:
    """The `rope_type: llama3` parameters behind llama.cpp's `rope_freqs` tensor.

    llama.cpp divides each rope frequency by a factor: 1 at high frequencies, `factor` at low
    ones, and 1 / ((1 - s) / factor + s) in between, with s linear in 1 / wavelength. Only that
    line matters, so low_freq_factor is fixed at 1 and the rest fitted; the result is checked.
    """
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    s = (1 / factors - 1 / factor) / (1 - 1 / factor)  # 1: high frequency, 0: low
    mid = (s > 1e-4) & (s < 1 - 1e-4)
    lo, hi = 1.0, 4.0  # Llama 3.x's values, kept unless the smooth band says otherwise
    if mid.sum() >= 2:  # s = (L / wavelen - lo) / (hi - lo)
        slope, icpt = np.polyfit(1 / wavelen[mid], s[mid], 1)
        hi, orig = 1 - 1 / icpt, -slope / icpt
    elif mid.any():
        orig = float(np.median(wavelen[mid] * (lo + s[mid] * (hi - lo))))
    else:  # any length between the last unscaled and the first fully scaled wavelength
        orig = float(np.sqrt(hi * wavelen[s >= 1].max(initial=1.0) * wavelen[s <= 0].min()))
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": lo,
        "high_freq_factor": float(hi),
        "original_max_position_embeddings": round(orig),
    }
    if not np.allclose(_llama3_factors(params, wavelen), factors, rtol=1e-3):
        raise ConfigError(
            f"{path}: {ROPE_FREQS} holds rope frequency factors that match no llama3 rope "
            "scaling; this kind of rope scaling is not supported"
        )
    return params


def _llama3_factors(p: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    """What llama.cpp's converter writes for these llama3 parameters (convert_hf_to_gguf.py)."""
    orig, lo, hi = (
        p["original_max_position_embeddings"],
        p["low_freq_factor"],
        p["high_freq_factor"],
    )
    s = np.clip((orig / wavelen - lo) / (hi - lo), 0.0, 1.0)
    return 1 / ((1 - s) / p["factor"] + s)
