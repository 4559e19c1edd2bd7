"""Casts shared by the Triton kernels, made to round the same on a GPU and in the interpreter.

The CPU interpreter (TRITON_INTERPRET=1) stores bf16 as uint16 in numpy: it truncates fp32 to
bf16 instead of rounding to nearest even, and `tl.dot` on bf16 operands returns garbage. Under
the interpreter these helpers emulate the GPU (bit-level RTNE, fp32 dot operands, which give the
same products as a bf16 MMA with fp32 accumulation); compiled for a GPU they are plain casts.
"""

import triton
import triton.language as tl

from kernels.dispatch import interpreting

INTERPRETED = interpreting()
_EMULATE = tl.constexpr(INTERPRETED)


@triton.jit
def round_to(x, dt: tl.constexpr):
    """fp32 x -> dtype dt, rounding to nearest even."""
    if _EMULATE and dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dt)


@triton.jit
def mma(a, b):
    """a @ b accumulated in fp32: tensor cores for 16-bit operands; for fp32 operands exact
    fp32 products ("ieee"), not tl.dot's TF32 default, which would break fp32 parity."""
    if _EMULATE:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def tanh(x):
    """tanh of fp32 x as 2 * sigmoid(2x) - 1: one exp, and it runs in the interpreter too."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def e2m1_doubled(q):
    """MXFP4 codes q (0..15: sign, 2 exponent bits, 1 mantissa bit) -> fp32 twice their e2m1
    value: ggml's kvalues_mxfp4 (0, 1, 2, 3, 4, 6, 8, 12, then negated; code 8 is +0.0)."""
    m = (q & 7).to(tl.int32)
    v = tl.where(m < 2, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
    return tl.where((q & 8) != 0, -v, v).to(tl.float32)


@triton.jit
def e8m0_half(e):
    """e8m0 exponents e (uint8) -> fp32 2^(e - 128) built from its bits, as ggml's
    ggml_e8m0_to_fp32_half (e < 2: the subnormals 2^-128, 2^-127); half of the MXFP4 scale,
    which the doubled codes of `e2m1_doubled` make whole again."""
    e = e.to(tl.int32)
    bits = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23)  # no shift >= 32
    return bits.to(tl.float32, bitcast=True)
