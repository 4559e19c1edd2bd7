"""DeepSeek sparse attention's latent attention (`kernels.sparse_mla_attention`): the torch
reference restricted to a key selection, and the Triton MLA kernels (decode and prefill) with
the selection masking their scores, against it (under TRITON_INTERPRET=1 without a GPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_harness import DEVICE, DTYPES, assert_close, randn, triton_op

import kernels
from core.layers.dsa import causal
from kernels import KernelError, dispatch, reference
from kernels.dispatch import kernel_module

TOL = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (2**-6, 2**-6)}  # as MLA's (decode tests)


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


def top_k(start_pos, b: int, t: int, s: int, k: int, seed: int = 5) -> torch.Tensor:
    """(B, T, S) bool: each query's top-k visible keys by random scores, as the indexer picks
    them (core.layers.dsa.Indexer): with k >= the visible keys, all of them."""
    g = torch.Generator().manual_seed(seed)
    visible = causal(start_pos, t, s, "cpu").expand(b, t, s)
    index = torch.rand(b, t, s, generator=g).masked_fill(~visible, float("-inf"))
    top = index.topk(min(k, s), dim=-1).indices
    chosen = torch.zeros(b, t, s, dtype=torch.bool).scatter_(-1, top, True) & visible
    return chosen.to(DEVICE)


def mla_inputs(b, h, t, s, r, dr, dtype):
    """q_lat, q_pe (B, H, T, .) and latent, k_pe slices [:b, :s] of a larger cache."""
    q_lat, q_pe = randn(b, h, t, r, dtype=dtype), randn(b, h, t, dr, dtype=dtype, seed=3)
    latent = randn(b + 1, s + 3, r, dtype=dtype, seed=1)[:b, :s]
    k_pe = randn(b + 1, s + 3, dr, dtype=dtype, seed=2)[:b, :s]
    return q_lat, q_pe, latent, k_pe


def check(q_lat, q_pe, latent, k_pe, start, keep, dtype):
    scale = (q_lat.shape[-1] + q_pe.shape[-1]) ** -0.5
    got = triton_op("sparse_mla_attention")(q_lat, q_pe, latent, k_pe, start, scale, keep)
    want = reference.mla_attention(q_lat, q_pe, latent, k_pe, start, scale, keep)
    assert_close(got, want, TOL[dtype])
    # not vacuous: the selection changes the output (unless it kept every visible key)
    dense = reference.mla_attention(q_lat, q_pe, latent, k_pe, start, scale)
    every = (keep == causal(start, keep.shape[1], keep.shape[2], DEVICE)).all()
    assert every or (got.float() - dense.float()).abs().max() > 0.05


# (B, H, R, Dr, S, top-k): S = cache length with the new token; top-k < S and >= S
DECODE = [(2, 4, 16, 8, 37, 5), (1, 5, 24, 8, 9, 64), (3, 16, 32, 16, 50, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE, ids=str)
def test_decode_reads_only_the_selected_keys(case, dtype):
    b, h, r, dr, s, k = case
    keep = top_k(s - 1, b, 1, s, k)
    check(*mla_inputs(b, h, 1, s, r, dr, dtype), s - 1, keep, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_at_their_own_positions(dtype):
    b, s = 3, 40
    start = torch.tensor([39, 0, 21], device=DEVICE)
    for k in (4, 64):  # fewer keys than the rows see, and more
        keep = top_k(start.cpu(), b, 1, s, k)
        check(*mla_inputs(b, 4, 1, s, 16, 8, dtype), start, keep, dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_splits_that_keep_no_key(num_splits):
    # the selection leaves whole splits (and key tiles) empty: they must weigh nothing
    b, h, r, dr, s = 2, 4, 16, 8, 70
    q_lat, q_pe, latent, k_pe = mla_inputs(b, h, 1, s, r, dr, torch.float32)
    keep = torch.zeros(b, 1, s, dtype=torch.bool, device=DEVICE)
    keep[0, 0, [0, 69]] = True
    keep[1, 0, 35] = True  # one key: the output is its latent
    dec = kernel_module("kernels.decode_attention")
    got = dec.mla_decode_attention(q_lat, q_pe, latent, k_pe, 0.2, None, num_splits, keep=keep)
    want = reference.mla_attention(q_lat, q_pe, latent, k_pe, s - 1, 0.2, keep)
    assert_close(got, want, TOL[torch.float32])
    assert_close(got[1, :, 0], latent[1, 35].expand(h, r), TOL[torch.float32])


# (B, H, R, Dr, T, start, top-k): T crosses the interpreter's 16-row tiles
PREFILL = [(2, 3, 16, 8, 20, 0, 6), (1, 4, 24, 8, 7, 5, 3), (2, 2, 16, 8, 18, 3, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL, ids=str)
def test_prefill_reads_only_the_selected_keys(case, dtype):
    b, h, r, dr, t, start, k = case
    s = start + t
    keep = top_k(start, b, t, s, k)
    check(*mla_inputs(b, h, t, s, r, dr, dtype), start, keep, dtype)


def test_prefill_rows_at_their_own_positions():
    b, t, s = 3, 6, 30
    start = torch.tensor([24, 0, 11], device=DEVICE)
    keep = top_k(start.cpu(), b, t, s, 4)
    check(*mla_inputs(b, 4, t, s, 16, 8, torch.float32), start, keep, torch.float32)


def test_bad_selection_raises():
    q_lat, q_pe, latent, k_pe = mla_inputs(1, 2, 1, 9, 16, 8, torch.float32)
    op = triton_op("sparse_mla_attention")
    with pytest.raises(KernelError, match=r"keep must be \(1, 1, 9\) bool"):
        op(q_lat, q_pe, latent, k_pe, 8, 0.2, torch.ones(1, 1, 8, dtype=torch.bool))
    with pytest.raises(KernelError, match="keep must be"):
        op(q_lat, q_pe, latent, k_pe, 8, 0.2, torch.ones(1, 1, 9))


@pytest.mark.parametrize("mode", ["auto", "torch", "triton"])
def test_policies(monkeypatch, mode):
    # triton: the kernels; torch and auto (until measured on a GPU): the reference
    monkeypatch.setenv("ZOO_KERNELS", mode)
    monkeypatch.setattr(dispatch, "_chosen", {})
    q_lat, q_pe, latent, k_pe, start, keep = (
        x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in inputs()
    )
    per_row = torch.tensor([start, start - 1], device=DEVICE)  # rows at their own positions
    got = kernels.sparse_mla_attention(q_lat, q_pe, latent, k_pe, per_row, 0.3, keep)
    want = reference.mla_attention(q_lat, q_pe, latent, k_pe, per_row, 0.3, keep)
    chosen = [key for key in dispatch._chosen if key[0] == "sparse_mla_attention"]
    assert bool(chosen) == (mode != "auto")
    if mode == "triton":
        assert dispatch._chosen[chosen[0]] is not reference.sparse_mla_attention
        assert_close(got, want, TOL[torch.float32])
    else:
        assert torch.equal(got, want)
