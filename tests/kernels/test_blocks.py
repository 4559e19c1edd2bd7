"""GGML block weights on CPUs (kernels/blocks.py, kernels/cpu/qformats.c and qdot.c), on every
instruction set the library is built for (this machine's, x86-64-v3 = AVX2, x86-64 = plain C,
and where the CPU has AVX-512, skylake-avx512 = AVX-512 without VNNI):

- repacking is lossless: the blocks dequantize to the `gguf` package's floats bit for bit, in
  any row order, stacked from several tensors, for row counts that are not whole groups;
- x's quantization (8-bit blocks, twice) is the torch reference's bit for bit;
- a product equals the float64 product of the quantized x and the dequantized weight to fp32
  rounding, few rows or many;
- a row's result is the same bit for bit alone, in a batch, on one thread or two.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from fixtures.block_weights import random_blocks
from gguf import GGMLQuantizationType, quants

from kernels import blocks
from kernels.cpu import build
from kernels.qweight import quantize

T = GGMLQuantizationType
KINDS = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "mxfp4"]


def _has_avx512bw() -> bool:
    try:
        return " avx512bw" in open("/proc/cpuinfo").read()
    except OSError:
        return False


MARCHES = ["native", "x86-64-v3", "x86-64"] + (["skylake-avx512"] if _has_avx512bw() else [])


@pytest.fixture(scope="module", params=MARCHES)
def lib(request):
    built = build.build(request.param)
    if built is None:
        pytest.fail(f"the C library does not build for -march={request.param}")
    return built


def repacked(lib, kind: str, sources: list[np.ndarray], cols: int, orders=None):
    """(the repacked bytes, the C view of them) made by `lib`."""
    fmt = blocks.FORMATS[kind]
    rows = []
    for i, src in enumerate(sources):
        order = np.arange(src.shape[0]) if orders is None or orders[i] is None else orders[i]
        rows.append(src.ctypes.data + order.astype(np.int64) * src.shape[1])
    rows = np.ascontiguousarray(np.concatenate(rows))
    n = len(rows)
    out = torch.empty(lib.zoo_repacked_bytes(fmt.type, n, cols), dtype=torch.uint8)
    lib.zoo_repack(fmt.type, rows.ctypes.data, n, cols, out.data_ptr(), 2)
    return out, build.QWeightView(out.data_ptr(), n, cols, fmt.type)


def dequantized(lib, view, rows: int, cols: int) -> torch.Tensor:
    out = torch.empty(rows, cols)
    lib.zoo_dequantize_rows(ctypes.byref(view), None, rows, out.data_ptr(), 2)
    return out


def product(lib, view, x: torch.Tensor, threads: int = 2) -> torch.Tensor:
    y = torch.empty(x.shape[0], view.N)
    lib.zoo_qgemm(ctypes.byref(view), x.contiguous().data_ptr(), y.data_ptr(), x.shape[0], threads)
    return y


@pytest.mark.parametrize("kind", KINDS)
def test_repacking_is_lossless(lib, kind):
    cols = 512
    a, b = random_blocks(kind, 37, cols, 1), random_blocks(kind, 11, cols, 2)  # 48 rows: 3 groups
    order = np.random.default_rng(3).permutation(37)
    buf, view = repacked(lib, kind, [a, b], cols, [order, None])
    want = np.concatenate([quants.dequantize(a, T[kind.upper()])[order],
                           quants.dequantize(b, T[kind.upper()])])  # fmt: skip
    got = dequantized(lib, view, 48, cols).numpy()
    assert np.array_equal(got, want)  # bit for bit: the same fp32 operations
    # the file's bytes, reordered: 48 rows are 3 whole groups of 16, each group's headers
    # padded to 64 bytes (at most 63 more per group)
    assert 48 * a.shape[1] <= buf.numel() <= 48 * a.shape[1] + 3 * 63


def q8_reference(x: torch.Tensor):
    """x (M, K) in 8-bit blocks of 32, twice, as kernels/cpu/qformats.c's zoo_q8_quantize_row: codes
    q1 = rint(x / d), d = max|x| / 127; the remainder's q2 = rint((x - d q1) / (d / 256))
    clamped to +-127; per block d / 256 and (d / 256) * sum(256 q1 + q2), per half block too."""
    m, k = x.shape
    b = x.view(m, k // 32, 32)
    amax = b.abs().amax(-1, keepdim=True)
    scale = amax / 127
    inv = torch.where(amax > 0, 1 / scale, torch.zeros_like(scale))
    q1 = torch.round(b * inv)  # ties to even, as rintf
    q2 = torch.round((b - scale * q1) * (inv * 256)).clamp(-127, 127)
    unit = (scale / 256)[..., 0]
    halves = (256 * q1.long() + q2.long()).view(m, k // 32, 2, 16).sum(-1)
    return (
        q1.to(torch.int8),
        q2.to(torch.int8),
        unit,
        unit * halves.sum(-1).float(),
        (unit[..., None] * halves.float()).flatten(1),
    )


class Q8Row(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("q", "q2", "d", "ds", "ds16")]


def test_x_is_quantized_as_the_reference(lib):
    g = torch.Generator().manual_seed(4)
    k = 320  # 10 blocks: one of zeros, one with a huge value among small ones, ties at .5
    x = torch.randn(3, k, generator=g)
    x[0, :32] = 0
    x[1, 32:64] = torch.randn(32, generator=g) * 1e-3
    x[1, 40] = 300.0
    x[2, 64:96] = torch.arange(-16, 16) * 0.5
    want = q8_reference(x)
    buf = torch.empty(lib.zoo_q8_row_bytes(k), dtype=torch.uint8)
    for r in range(3):
        row = Q8Row()
        lib.zoo_q8_quantize_row(x[r].contiguous().data_ptr(), k, buf.data_ptr(), ctypes.byref(row))

        def read(ptr, dtype, n):
            at = ptr - buf.data_ptr()
            return buf[at : at + n * dtype.itemsize].view(dtype)

        assert torch.equal(read(row.q, torch.int8, k), want[0][r].flatten())
        assert torch.equal(read(row.q2, torch.int8, k), want[1][r].flatten())
        assert torch.equal(read(row.d, torch.float32, k // 32), want[2][r])
        assert torch.equal(read(row.ds, torch.float32, k // 32), want[3][r])
        assert torch.equal(read(row.ds16, torch.float32, k // 16), want[4][r])


def x_quantized(x: torch.Tensor) -> torch.Tensor:
    """The values the kernels multiply: (d / 256) * (256 q1 + q2), in float64."""
    q1, q2, unit, *_ = q8_reference(x)
    whole = 256 * q1.double() + q2.double()
    return (whole * unit.double()[..., None]).flatten(1)


# Per block the kernels sum exact integers, then scale and accumulate in fp32: at most K / 32
# roundings of about 6e-8 of the running sum (K = 2304: 72 blocks, under 5e-6 in the worst case)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 40])
def test_products_equal_float64_of_the_quantized_x(lib, kind, rows):
    cols = 2304 if kind.endswith("_k") else 2080  # 65 blocks of 32: an odd count
    raw = random_blocks(kind, 37, cols, 5)
    _, view = repacked(lib, kind, [raw], cols)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    got = product(lib, view, x)
    want = x_quantized(x) @ torch.from_numpy(quants.dequantize(raw, T[kind.upper()])).double().T
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 5e-6


@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "q8_0", "q4_1"])
def test_a_row_is_the_same_alone_in_a_batch_and_on_any_thread_count(lib, kind):
    cols = 512
    _, view = repacked(lib, kind, [random_blocks(kind, 53, cols, 6)], cols)
    x = torch.randn(13, cols, generator=torch.Generator().manual_seed(7))
    batch = product(lib, view, x)
    for r in (0, 5, 12):
        assert torch.equal(product(lib, view, x[r : r + 1]), batch[r : r + 1])
        assert torch.equal(product(lib, view, x[r : r + 3], threads=1), batch[r : r + 3])


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_weights_quantized_at_load_become_the_same_blocks(kind):
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(8))
    q = quantize(w, kind)
    b = blocks.from_quant(q)
    assert b.fmt.name == blocks.AT_LOAD[kind]
    assert torch.equal(b.dequantize(), q.dequantize())


def test_block_weight_rows_and_errors():
    raw = random_blocks("q4_k", 20, 256, 9)
    w = blocks.repack("q4_k", [raw], (20, 256))
    full = torch.from_numpy(quants.dequantize(raw, T.Q4_K))
    assert torch.equal(w.dequantize(), full)
    ids = torch.tensor([[3, 19], [0, 3]])
    assert torch.equal(w.select_rows(ids), full[ids])
    with pytest.raises(IndexError, match="out of range"):
        w.dequantize(torch.tensor([20]))
    with pytest.raises(ValueError, match="bytes"):
        blocks.repack("q4_k", [raw[:, :-1].copy()], (20, 256))


def test_fp16_conversions_round_as_torch(lib):
    lib.zoo_float_to_half.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.zoo_half_to_float.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    g = torch.Generator().manual_seed(10)
    x = torch.cat([torch.randn(1000, generator=g) * 10.0 ** torch.randint(-9, 6, (1000,),
                   generator=g), torch.tensor([0.0, -0.0, 65504.0, 65520.0, 1e-8, -6e-8,
                   float("inf"), 2.0**-24, 3 * 2.0**-25])])  # fmt: skip
    h = torch.empty(len(x), dtype=torch.float16)
    lib.zoo_float_to_half(x.data_ptr(), h.data_ptr(), len(x))
    assert torch.equal(h.view(torch.int16), x.half().view(torch.int16))
    back = torch.empty(len(x))
    lib.zoo_half_to_float(h.data_ptr(), back.data_ptr(), len(x))
    assert torch.equal(back, h.float())


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "mxfp4"])  # (its edges: random_blocks)
def test_edge_blocks_repack_and_multiply(kind):
    """Blocks with zero and negative scales and every code at its maximum (test_qweight's edge
    cases), through the layer's own path (kernels.linear: 3-D x, a bias)."""
    from test_qweight import random_blocks as edge_blocks

    import kernels

    raw = np.ascontiguousarray(edge_blocks(kind, 40, 512, seed=11, edge=True))
    w = blocks.repack(kind, [raw], (40, 512))
    wd = torch.from_numpy(quants.dequantize(raw, T[kind.upper()]))
    assert torch.equal(w.dequantize(), wd)
    x = torch.randn(2, 5, 512, generator=torch.Generator().manual_seed(12))
    bias = torch.randn(40)
    got = kernels.linear(x, w, bias)
    want = (x_quantized(x.view(10, 512)) @ wd.double().T).view(2, 5, 40) + bias.double()
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 5e-6


def test_zoo_kernels_torch_multiplies_the_dequantized_weight(monkeypatch):
    import kernels

    raw = random_blocks("q6_k", 24, 256, 13)
    w = blocks.repack("q6_k", [raw], (24, 256))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(14))
    monkeypatch.setenv("ZOO_KERNELS", "torch")
    assert torch.equal(kernels.linear(x, w), torch.nn.functional.linear(x, w.dequantize()))


def test_block_products_inside_a_compiled_graph():
    """A compiled decode step reaches kernels/cpu/qdot.c through the custom op zoo::qdot, in one
    graph, with the eager results bit for bit."""
    import kernels

    w = blocks.repack("q4_k", [random_blocks("q4_k", 32, 512, 15)], (32, 512))
    g = torch.Generator().manual_seed(16)
    few, many = torch.randn(1, 512, generator=g), torch.randn(17, 512, generator=g)
    both = torch.compile(lambda a, b: (kernels.linear(a, w), kernels.linear(b, w)), fullgraph=True)
    got_few, got_many = both(few, many)
    assert torch.equal(got_few, kernels.linear(few, w))
    assert torch.equal(got_many, kernels.linear(many, w))
