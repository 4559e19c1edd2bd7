"""Attention's per-layer features through the Triton kernels (decode and prefill) against
kernels.reference: a sliding window shorter than the sequence, logit soft-capping, per-head
sinks, a softmax scale of the caller's; and the reference itself against the formulas."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_harness import DEVICE, DTYPES, assert_close, randn, triton_op

from kernels import KernelError, reference
from kernels.dispatch import kernel_module

# as test_kernel_decode_attention / test_kernel_prefill_attention: online softmax in another
# order (fp32: a few ulp); bf16: P cast before P @ V, then the output cast once
TOL = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (2**-6, 2**-6)}
# (window, softcap, with sinks): each feature alone, then all together
FEATURES = [(5, None, False), (None, 3.0, False), (None, None, True), (7, 2.0, True)]


def sinks_for(hq: int, on: bool):
    # around the scores' size, so the sink takes a visible share of each softmax
    return randn(hq, dtype=torch.float32, seed=9) * 2 if on else None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("feat", FEATURES, ids=str)
def test_decode_features(feat, num_splits, dtype):
    window, softcap, with_sinks = feat
    b, hq, hkv, d, s = 3, 6, 2, 24, 37
    lens = torch.tensor([37, 3, 20], device=DEVICE)  # one row shorter than the window
    q = randn(b, hq, 1, d, dtype=dtype) * 3
    k = randn(b, hkv, s, d, dtype=dtype, seed=1)
    v = randn(b, hkv, s, d, dtype=dtype, seed=2)
    sinks = sinks_for(hq, with_sinks)
    dec = kernel_module("kernels.decode_attention")
    got = dec.decode_attention(
        q, k, v, 0.3, lens, num_splits, window=window, softcap=softcap, sinks=sinks
    )
    want = reference.attention(q, k, v, lens - 1, 0.3, window, softcap, sinks)
    assert_close(got, want, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("feat", FEATURES, ids=str)
def test_prefill_features(feat, per_row, dtype):
    window, softcap, with_sinks = feat
    b, hq, hkv, d, t = 2, 4, 2, 16, 21  # T past one 16-wide tile: windows cross tile edges
    start = torch.tensor([3, 11], device=DEVICE) if per_row else 6
    s = 11 + t
    q = randn(b, hq, t, d, dtype=dtype) * 3
    k = randn(b, hkv, s, d, dtype=dtype, seed=1)
    v = randn(b, hkv, s, d, dtype=dtype, seed=2)
    sinks = sinks_for(hq, with_sinks)
    got = triton_op("attention")(q, k, v, start, 0.3, window, softcap, sinks)
    want = reference.attention(q, k, v, start, 0.3, window, softcap, sinks)
    assert_close(got, want, TOL[dtype])


def test_window_of_one_sees_only_the_token_itself():
    q = randn(1, 2, 5, 8)
    k, v = randn(1, 2, 9, 8, seed=1), randn(1, 2, 9, 8, seed=2)
    got = triton_op("attention")(q, k, v, 4, 0.5, 1)
    assert_close(got, v[:, :, 4:9], TOL[torch.float32])


def test_reference_matches_the_formulas():
    """Window, soft-cap and sinks written out for one query of one head, as transformers
    computes them (Gemma 2's tanh cap after the scale, gpt-oss's sink column)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 10, 8), torch.randn(1, 1, 10, 8)
    sinks = torch.tensor([0.7])
    got = reference.attention(q, k, v, 9, 0.4, 4, 2.5, sinks)
    scores = 2.5 * torch.tanh(q[0, 0, 0] @ k[0, 0, 6:].T * 0.4 / 2.5)  # positions 6..9
    w = torch.cat((scores, sinks)).softmax(-1)[:4]
    assert torch.allclose(got[0, 0, 0], w @ v[0, 0, 6:], atol=1e-6)
    # the plain path (SDPA) and the written-out one agree on a window alone
    math_ = reference._attention_math(q, k, v, 9, 0.4, 4)
    assert torch.allclose(reference.attention(q, k, v, 9, 0.4, 4), math_, atol=1e-6)
    assert not torch.allclose(reference.attention(q, k, v, 9, 0.4), math_, atol=1e-3)
    assert math.isfinite(got.abs().max().item())


def test_bad_features_are_refused():
    q, k = randn(1, 2, 3, 8), randn(1, 2, 3, 8)
    with pytest.raises(KernelError, match="window 0"):
        triton_op("attention")(q, k, k, 0, 0.5, 0)
    with pytest.raises(KernelError, match=r"sinks \(3,\) != \(2,\)"):
        triton_op("attention")(q, k, k, 0, 0.5, None, None, torch.zeros(3, device=DEVICE))
