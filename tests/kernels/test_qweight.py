"""Quantized weights: GGML blocks repacked losslessly (bit for bit against the `gguf` package's
own dequantization), int8 / int4 quantized at load within half a step, and the layer's output
against F.linear with the dequantized weight."""

from __future__ import annotations

import contextlib

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize

from kernels.qweight import QuantWeight, cat_rows
from kernels.qweight import quantize as quantize_weight
from plugins.gguf_quant import KEPT, repack

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
    assert ratio["q8_0"] == ratio["q4_0"] == ratio["q4_1"] == 1.0
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


def weight(kind: str) -> QuantWeight:
    if kind in KEPT:
        return repack(kind, random_blocks(kind, 48, 512, seed=2, edge=True), (48, 512))
    return quantize_weight(torch.randn(48, 512, generator=torch.Generator().manual_seed(2)), kind)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    # fp32 rounding of 512-term dot products summed in another order (and, with several rows,
    # of s * q + (min - offset * s) against s * (q - offset) + min)
    return torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def expected(x: torch.Tensor, w: QuantWeight, bias=None, lib=None) -> torch.Tensor:
    """F.linear with the reference-dequantized weight, on x as the kernel reads it: rounded to
    bf16 where it multiplies 4-bit codes in bf16 (the ISA and the row count decide)."""
    from kernels import cpu_quant

    if cpu_quant.rounds_x_to_bf16(w, x, lib):
        x = x.bfloat16().float()
    return F.linear(x, w.dequantize(), bias)


LINEAR_KINDS = ["q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k", "int8", "int4"]


@pytest.mark.parametrize("rows", [1, 3, 17, 80])
@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_linear_equals_f_linear_on_the_dequantized_weight(kind, rows):
    import kernels

    w = weight(kind)
    x = torch.randn(2, rows, 512, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(48)
    assert close(kernels.linear(x, w, bias), expected(x, w, bias))


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "plain-c"])
@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_c_kernel_without_avx512(kind, march):
    """The AVX2 and plain-C builds of kernels/qgemv.c (this machine runs the AVX-512 one)."""
    import platform

    from kernels import cpu_quant

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 instruction sets")
    lib = cpu_quant.build(march)
    assert lib is not None
    w = weight(kind)
    for rows in (1, 5):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        got = cpu_quant._run(x, w.fmt, 512, w.codes, w.scales, w.mins, w.d, w.dmin, lib=lib)
        assert close(got, expected(x, w, lib=lib))


def test_c_kernel_inside_a_compiled_graph():
    """A compiled decode step reaches the C kernel through its custom ops (zoo::qgemv for few
    rows, zoo::qdequantize for many) in one graph, with the eager results."""
    import kernels
    from kernels import cpu_quant

    cpu_quant.library()  # built eagerly first, as kernels.dispatch.prepare does
    w = weight("q4_1")
    g = torch.Generator().manual_seed(4)
    few, many = torch.randn(1, 512, generator=g), torch.randn(17, 512, generator=g)
    both = torch.compile(lambda a, b: (kernels.linear(a, w), kernels.linear(b, w)), fullgraph=True)
    for decoding in (False, True):  # in a decode step few rows may multiply bf16(x)
        with cpu_quant.decoding() if decoding else contextlib.nullcontext():
            got_few, got_many = both(few, many)
            assert close(got_few, expected(few, w))
            assert close(got_many, expected(many, w))


@pytest.mark.parametrize("inp", [96, 160, 576])  # 128-column chunks and a partial last one
@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "int4"])
def test_bf16_codes_path(kind, inp):
    """Where 4-bit codes multiply bf16(x) (AVX512-BF16 CPUs, in a decode step): F.linear of
    bf16(x) to fp32 rounding for 1..8 rows, and within bf16 rounding of F.linear on x itself."""
    from kernels import cpu_quant

    if kind == "int4":
        w = quantize_weight(torch.randn(37, inp, generator=torch.Generator().manual_seed(5)), kind)
    else:
        w = repack(kind, random_blocks(kind, 37, inp, seed=inp, edge=True), (37, inp))
    with cpu_quant.decoding():
        if not cpu_quant.rounds_x_to_bf16(w, torch.zeros(1, inp)):
            pytest.skip("this CPU has no AVX512-BF16: the fp32 path runs (tested above)")
    wd = w.dequantize().double()
    for rows in (1, 2, 8):
        x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)) * 4
        with cpu_quant.decoding():
            got = cpu_quant.quant_linear(x, w).double()
        size = x.abs().double() @ wd.abs().T  # what the rounding of each term scales with
        # the kernel sums s * (128 + q) * x in fp32, then takes s * 128 * sum(x) away
        steps = w.group_scales().abs().double().repeat_interleave(32, dim=-1)
        summed = x.abs().double() @ (steps * 144).T
        assert ((got - x.bfloat16().double() @ wd.T).abs() <= 1e-6 * (size + summed)).all()
        assert ((got - x.double() @ wd.T).abs() <= 2**-9 * size + 1e-6 * summed).all()


@pytest.mark.parametrize("kind", ["q4_1", "int4", "q8_0"])
def test_prefill_keeps_fp32_x_whatever_its_chunk(kind):
    """Outside a decode step the kernel multiplies fp32 x however few rows it gets: the last
    token of a prompt prefilled alone (a server reusing a cached prefix) gets the products it
    gets inside a longer chunk, to fp32 rounding (bf16(x) would be ~1e-3 off)."""
    from kernels import cpu_quant

    w = weight(kind)
    x = torch.randn(1, 12, 512, generator=torch.Generator().manual_seed(4))
    whole = cpu_quant.quant_linear(x, w)  # 12 rows: the BLAS on the dequantized weight
    for tail in (1, 2, 8):
        alone = cpu_quant.quant_linear(x[:, -tail:].contiguous(), w)  # the C kernel
        assert close(alone, whole[:, -tail:])
        assert close(alone, F.linear(x[:, -tail:], w.dequantize()))
