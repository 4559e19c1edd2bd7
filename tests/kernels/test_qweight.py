"""Quantized weights: GGML blocks repacked losslessly (bit for bit against the `gguf` package's
own dequantization), int8 / int4 quantized at load within half a step, and the layer's output
against F.linear with the dequantized weight."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize

from kernels.qweight import cat_rows
from kernels.qweight import quantize as quantize_weight
from plugins.formats.gguf_quant import KEPT, repack

T = gguf.GGMLQuantizationType
# where each block type keeps its fp16 fields (d, then dmin or m)
F16_AT = {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2],
          "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}  # fmt: skip


def random_blocks(kind: str, out: int, inp: int, seed: int, edge: bool = False) -> np.ndarray:
    """Random bytes for (out, inp) weights of a block type, with finite fp16 scales; `edge`
    sets some scales to zero, makes some negative, and saturates some codes (all bits set)."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[T[kind.upper()]]
    raw = rng.integers(0, 256, (out, inp // block, size), dtype=np.uint8)
    if kind == "mxfp4":  # e8m0 scales 2^-28 .. 2^11 (edges: the subnormal halves 0 and 1)
        raw[..., 0] = rng.integers(100, 140, raw.shape[:2])
        if edge:
            raw[0, :, 0] = np.resize([0, 1], raw.shape[1])
            raw[1, :, 1:], raw[2, :, 1:] = 0xFF, 0x00  # every code -6.0, and +0.0
        return raw.reshape(out, -1)
    for at in F16_AT[kind]:
        raw[..., at + 1] &= 0xBB  # exponent below 31: finite, either sign
        if edge:
            raw[0, :, at : at + 2] = 0  # a zero scale
            raw[-1, :, at + 1] |= 0x80  # negative
    if edge:
        fields = [at + i for at in F16_AT[kind] for i in (0, 1)]
        codes = np.setdiff1d(np.arange(size), fields)
        raw[1, :, codes] = 0xFF  # every code at its maximum
        raw[2, :, codes] = 0x00  # and at its minimum
    return raw.reshape(out, -1)


def bits(a: np.ndarray | torch.Tensor) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("edge", [False, True], ids=["random", "edges"])
@pytest.mark.parametrize("kind", KEPT)
def test_repacked_blocks_dequantize_bit_for_bit(kind, edge):
    block = gguf.GGML_QUANT_SIZES[T[kind.upper()]][0]
    out, inp = 7, block * 3  # odd row count, several blocks per row
    raw = random_blocks(kind, out, inp, seed=len(kind), edge=edge)
    want = dequantize(raw, T[kind.upper()])
    w = repack(kind, raw, (out, inp))
    assert np.array_equal(bits(w.dequantize()), bits(want))
    rows = torch.tensor([6, 0, 3, 3])
    assert np.array_equal(bits(w.select_rows(rows)), bits(want[rows.numpy()]))


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_repacked_from_real_quantization(kind):
    """Blocks that the gguf package's own quantizer wrote (not random bytes)."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(5, 96, generator=g) * 3).numpy()
    raw = quantize(w, T[kind.upper()])
    want = dequantize(raw, T[kind.upper()])
    assert np.array_equal(bits(repack(kind, raw, (5, 96)).dequantize()), bits(want))


def test_nbytes_follow_the_file():
    """Resident bytes of the kept formats against the GGML block sizes (Q5/Q6 codes widened to
    a byte: stated in docs/quantization.md)."""
    ratio = {}
    for kind in KEPT:
        block, size = gguf.GGML_QUANT_SIZES[T[kind.upper()]]
        w = repack(kind, random_blocks(kind, 4, 512, seed=1), (4, 512))
        ratio[kind] = w.nbytes / (4 * 512 // block * size)
    assert ratio["q8_0"] == ratio["q4_0"] == ratio["q4_1"] == ratio["mxfp4"] == 1.0
    assert ratio["q4_k"] < 1.03  # its 6-bit scales and mins unpacked to a byte each
    # one byte per 5- or 6-bit code: 8 / 6.5625 bits for Q6_K, 8 / 5.5 for Q5_*
    assert ratio["q6_k"] < 1.31 and max(ratio.values()) < 1.6


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantize_at_load_within_half_a_step(kind):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g) * 2
    w[3] = 0  # an all-zero row: scale 0, no NaN
    q = quantize_weight(w, kind)
    deq = q.dequantize()
    step = q.group_scales().repeat_interleave(q.fmt.group_of(96), dim=-1)
    assert torch.isfinite(deq).all()
    # half a step, plus the fp16 rounding of int4's minimum
    assert ((deq - w).abs() <= step / 2 + 1e-3 * w.abs().amax()).all()
    assert (deq[3] == 0).all()


def test_cat_rows_stacks_parts():
    raw = [random_blocks("q4_k", n, 256, seed=n) for n in (3, 5)]
    parts = [repack("q4_k", r, (r.shape[0], 256)) for r in raw]
    both = cat_rows(parts)
    assert both.shape == (8, 256)
    assert torch.equal(both.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_on_cpus_a_quant_weight_runs_the_dequantizing_reference():
    """`QuantWeight` is Triton's layout, made for GPUs; on CPUs weights kept quantized are
    `kernels.blocks.BlockWeight`s (tests/kernels/test_blocks.py), and a QuantWeight that
    reaches a CPU layer runs the reference: F.linear with its dequantized weight."""
    import kernels

    w = repack("q4_k", random_blocks("q4_k", 48, 512, seed=2, edge=True), (48, 512))
    x = torch.randn(2, 3, 512, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(48)
    assert torch.equal(kernels.linear(x, w, bias), F.linear(x, w.dequantize(), bias))


def test_mxfp4_every_code_and_exponent_bit_for_bit():
    """All 16 e2m1 codes (in both nibbles) under all 256 e8m0 exponents (the subnormal halves
    0 and 1, 255's infinities): the kept weight, the `gguf` package and the CPU's repacked
    `BlockWeight` give the same floats, bit for bit."""
    from kernels import blocks

    raw = np.zeros((256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    raw[:, 1:] = np.arange(16) | (np.arange(15, -1, -1) << 4)  # byte j: codes j and 15 - j
    with np.errstate(over="ignore"):  # exponents 254, 255: 8 * 2^126 and up are inf
        want = bits(dequantize(raw, T.MXFP4))
    w = repack("mxfp4", raw, (256, 32))
    assert np.array_equal(bits(w.dequantize()), want)
    assert w.dequantize()[255].isinf().any() and (want[:, 8] == 0).all()  # code 8: +0.0
    if blocks.available():
        assert np.array_equal(bits(blocks.repack("mxfp4", [raw], (256, 32)).dequantize()), want)


def test_mxfp4_from_safetensors_layout():
    """gpt-oss's `_blocks` (values 2j, 2j + 1 in byte j) + `_scales` kept (`keep`): the floats
    of the same bytes as GGML blocks (`to_ggml`, what llama.cpp's converter writes) bit for bit,
    and transformers' dequantization in value (its code 8 is -0.0); stacked experts too."""
    from plugins.formats import safetensors_mxfp4 as st

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (3, 5, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 255, (3, 5, 4), generator=g, dtype=torch.uint8)
    experts = st.keep(codes, scales)
    assert experts.shape == (3, 5, 128) and experts.codes.shape == (3, 5, 64)
    for e in range(3):
        one = st.keep(codes[e], scales[e])
        ggml = st.to_ggml(codes[e], scales[e])
        want = dequantize(np.ascontiguousarray(ggml), T.MXFP4)
        assert np.array_equal(bits(one.dequantize()), bits(want))
        assert np.array_equal(bits(experts.dequantize(e)), bits(want))
        assert torch.equal(one.dequantize(), st.dequantize(codes[e], scales[e]))
