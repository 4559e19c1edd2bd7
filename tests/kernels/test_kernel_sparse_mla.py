"""DeepSeek sparse attention's latent attention (`kernels.sparse_mla_attention`): the torch
reference restricted to a key selection, on every ZOO_KERNELS policy (no Triton kernel)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference


def inputs(b=2, h=3, t=5, s=9, r=8, dr=4, start=4):
    g = torch.Generator().manual_seed(0)
    q_lat, q_pe = torch.randn(b, h, t, r, generator=g), torch.randn(b, h, t, dr, generator=g)
    latent, k_pe = torch.randn(b, s, r, generator=g), torch.randn(b, s, dr, generator=g)
    keep = torch.rand(b, t, s, generator=g) < 0.5
    keep[:, torch.arange(t), start + torch.arange(t)] = True  # each query keeps itself
    return q_lat, q_pe, latent, k_pe, start, keep


def by_hand(q_lat, q_pe, latent, k_pe, start, keep, scale):
    """Per row and query: softmax over its kept, visible keys only, then their latents."""
    b, _, t, _ = q_lat.shape
    out = torch.zeros_like(q_lat)
    for i in range(b):
        for j in range(t):
            cols = [c for c in range(start + j + 1) if keep[i, j, c]]
            scores = q_lat[i, :, j] @ latent[i, cols].T + q_pe[i, :, j] @ k_pe[i, cols].T
            out[i, :, j] = torch.softmax(scores * scale, dim=-1) @ latent[i, cols]
    return out


def test_reference_reads_only_the_kept_keys():
    args = inputs()
    want = by_hand(*args, scale=0.3)
    q_lat, q_pe, latent, k_pe, start, keep = args
    got = reference.mla_attention(q_lat, q_pe, latent, k_pe, start, 0.3, keep)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # every key kept (the visible ones): plain MLA
    every = torch.ones_like(keep)
    dense = reference.mla_attention(q_lat, q_pe, latent, k_pe, start, 0.3)
    assert torch.equal(reference.mla_attention(q_lat, q_pe, latent, k_pe, start, 0.3, every), dense)
    assert (got - dense).abs().max() > 1e-2


@pytest.mark.parametrize("mode", ["auto", "torch", "triton"])
def test_every_policy_runs_the_reference(monkeypatch, mode):
    monkeypatch.setenv("ZOO_KERNELS", mode)
    q_lat, q_pe, latent, k_pe, start, keep = inputs()
    per_row = torch.tensor([start, start - 1])  # rows at their own positions
    got = kernels.sparse_mla_attention(q_lat, q_pe, latent, k_pe, per_row, 0.3, keep)
    want = reference.mla_attention(q_lat, q_pe, latent, k_pe, per_row, 0.3, keep)
    assert torch.equal(got, want)
