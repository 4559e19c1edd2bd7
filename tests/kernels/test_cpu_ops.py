"""kernels/cpu/ops.py (one C call per small op on CPUs) against the torch references."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.cpu import ops
from kernels.cpu.build import library

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the references run")


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("scale", [1.0, 1e-3])  # at 1e-3, eps outweighs mean(x^2)
@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 3, 40), (5, 17)])
def test_rms_norm(shape, scale):
    x, w = randn(*shape, scale=scale), randn(shape[-1], seed=1)
    want = reference.rms_norm(x, w, 1e-5)
    # the same formula; only the fp32 sum of squares runs in another order: 1-2 ulp
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), want, rtol=3e-7, atol=0)
    r = randn(*shape, seed=2, scale=scale)
    got, h = ops.rms_norm_residual(x, r, w, 1e-5)
    want, want_h = reference.rms_norm_residual(x, r, w, 1e-5)
    assert torch.equal(h, want_h)
    torch.testing.assert_close(got, want, rtol=3e-7, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [64, 32])  # all dims, or a partial rotary factor
@pytest.mark.parametrize("t,rows", [(1, 1), (5, 1), (1, 3)])  # decode, prefill, per-row cos
def test_rope_in_place_on_a_fused_projection(interleaved, rot, t, rows):
    """q and k as the attention layer makes them: strided views of one q|k|v output."""
    b, hq, hk, d = 3, 4, 2, 64
    qkv = randn(b, t, (hq + 2 * hk) * d)
    q = qkv[..., : hq * d].view(b, t, hq, d).transpose(1, 2)
    k = qkv[..., hq * d : (hq + hk) * d].view(b, t, hk, d).transpose(1, 2)
    v_before = qkv[..., (hq + hk) * d :].clone()
    cos, sin = randn(rows, t, rot // 2, seed=3), randn(rows, t, rot // 2, seed=4)
    want_q, want_k = reference.apply_rope(q.clone(), k.clone(), cos, sin, interleaved)
    got_q, got_k = ops.apply_rope(q, k, cos, sin, interleaved)
    # the reference's own products and sums, in its order: bit for bit
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[..., (hq + hk) * d :], v_before)  # v untouched


def test_other_inputs_take_the_reference():
    """bf16 tensors, and any call inside a torch.compile trace, run the references."""
    x, w = randn(2, 64).bfloat16(), randn(64, seed=1).bfloat16()
    assert torch.equal(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    x, w = randn(2, 64), randn(64, seed=1)
    compiled = torch.compile(ops.rms_norm, fullgraph=True)  # a ctypes call would break it
    torch.testing.assert_close(compiled(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize(
    "window,softcap,sinks",
    [(4, None, False), (None, 5.0, False), (None, None, True), (3, 2.0, True)],
)
@pytest.mark.parametrize("per_row", [False, True])
def test_decode_attention(window, softcap, sinks, per_row):
    """One query per row over a strided cache slice (as the layer passes it), GQA 6:2, with
    per-row positions or one for all, a window shorter than the slice, soft-cap and sinks
    (without any of them, decode stays on the reference's SDPA)."""
    b, hq, hk, s_max, d = 3, 6, 2, 16, 32
    q = randn(b, 1, hq * d).view(b, 1, hq, d).transpose(1, 2)
    cache_k, cache_v = randn(b, hk, s_max, d, seed=1), randn(b, hk, s_max, d, seed=2)
    start = torch.tensor([9, 3, 11]) if per_row else 11
    k, v = cache_k[:, :, :12], cache_v[:, :, :12]  # max(start) + 1 slots
    sink = randn(hq, seed=3) if sinks else None
    args = (q, k, v, start, d**-0.5, window, softcap, sink)
    want = reference.attention(*args)
    got = ops.attention(*args)
    # the same softmax, its sums in another order (docs/kernels.md's attention row)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_decode_attention_inside_a_compiled_step(monkeypatch):
    """A compiled decode step (per-row positions, a cache bucket longer than any row) reaches
    the C loop through zoo::decode_attention, with the reference's result."""
    calls = []
    real = ops._decode
    monkeypatch.setattr(ops, "_decode", lambda *a: calls.append(1) or real(*a))
    b, hq, hk, d = 2, 4, 2, 16
    q = randn(b, hq, 1, d)
    k, v = randn(b, hk, 32, d, seed=1), randn(b, hk, 32, d, seed=2)  # a bucket of 32 slots
    start = torch.tensor([5, 12])
    step = torch.compile(lambda *a: ops.attention(*a, d**-0.5), fullgraph=True)
    got = step(q, k, v, start)
    torch.testing.assert_close(
        got, reference.attention(q, k, v, start, d**-0.5), atol=2e-6, rtol=1e-5
    )
    assert calls  # the op ran the C loop, not the reference's bucket-wide matmuls
