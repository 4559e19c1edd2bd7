"""Quantized linear (W8A16 / W4A16): y = x @ W.T + bias for a `kernels.qweight.QuantWeight` W.

The codes are read as they are kept (a byte per code, or two 4-bit codes per byte) and turned
into weights in registers, never into a float copy in memory:

    w = round_to_x_dtype(scale(n, g) * (code - offset) + minimum(n, g))     (fp32 inside)

with the scale two-level for the K-quants (fp16 `d` per 256 columns times a small integer per
group), or for block-scaled fp8 (FP8) scale(n, g) * float32(code bitcast to float8_e4m3fn), one
fp32 product as in DeepSeek's weight_dequant, or for MXFP4 (MX) 2^(e - 128) * E2M1[code], the
e8m0 byte and the e2m1 nibble decoded by bits (kernels/casting.py), one exact product. Masked
code loads read 0 (+0.0 in fp8 and e2m1): a tile past the end of a row holds no NaN bit pattern
that its zero x would not cancel.

That is `QuantWeight.dequantize` followed by the reference's cast to x's dtype, so the
kernels differ from `reference.quant_linear` only in the order of the fp32 sums. Every format
parameter (bits, group, offset, minimum, super-block) is a constexpr: one specialisation per
format. Both kernels walk K one scale group at a time (an unrolled loop inside each K tile), so
a group's scale, minimum and d are one value per output feature, loaded once, not per weight.
A packed byte j of a 32-column group holds columns j and j + 16: the group's 16 bytes give a
"low" and a "high" run of 16 columns, each multiplied by its own 16 columns of x, so no nibble
shuffle is needed.

- GEMV (decode, up to GEMV_ROWS rows): program (block of output features, K split) multiplies
  its weight tiles by all rows of x at once (broadcast products accumulated in fp32 and summed
  over the group once at the end), so the weight is read once per step. Split-K fills the GPU
  when N is small: each split writes fp32 partials (splits, M, N) that a second kernel sums in
  split order and adds the bias to (no atomics: deterministic); one split writes y directly.
- Tiled (prefill): program (block of rows, block of output features) runs `tl.dot` over K with
  fp32 accumulation (tensor cores for fp16/bf16, exact fp32 products for fp32).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.casting import e2m1_doubled, e8m0_half, mma, round_to
from kernels.dispatch import interpreting, require
from kernels.qweight import QuantWeight

INTERPRETED = interpreting()
GEMV_ROWS = 8  # up to this many rows of x: the GEMV; more: the tiled kernel (tl.dot wants 16)


@triton.jit
def _group_terms(S, MN, D, DMIN, rows, mask, c0, s_s, s_m, s_d, s_dm, GROUP: tl.constexpr,
                 SUPER: tl.constexpr, HAS_MIN: tl.constexpr, MX: tl.constexpr):  # fmt: skip
    """fp32 (scale, minimum) of `rows` for the group holding column c0, computed as
    QuantWeight.dequantize does (K-quants: float(d) * float(sub-scale); MXFP4: 2^(e - 128));
    minimum is the scale again (unused) without HAS_MIN."""
    if GROUP == 0:
        g = 0
    else:
        g = c0 // GROUP
    scale = tl.load(S + rows * s_s + g, mask=mask, other=0)
    if MX:
        scale = e8m0_half(scale)
    else:
        scale = scale.to(tl.float32)
    if SUPER > 0:
        scale = tl.load(D + rows * s_d + c0 // SUPER, mask=mask, other=0).to(tl.float32) * scale
    mn = scale
    if HAS_MIN:
        mn = tl.load(MN + rows * s_m + g, mask=mask, other=0).to(tl.float32)
        if SUPER > 0:
            mn = tl.load(DMIN + rows * s_dm + c0 // SUPER, mask=mask, other=0).to(tl.float32) * mn
    return scale, mn


@triton.jit
def _weights(q, scale, mn, OFFSET: tl.constexpr, HAS_MIN: tl.constexpr, FP8: tl.constexpr,
             MX: tl.constexpr):  # fmt: skip
    """fp32 weights of integer codes q: scale * (q - offset) (+ minimum), rounded as
    QuantWeight.dequantize rounds (a product, then a sum); FP8: q's bytes are e4m3 floats;
    MX: q are e2m1 codes (the scale is half of MXFP4's, the values doubled)."""
    if FP8:
        w = scale * q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif MX:
        w = scale * e2m1_doubled(q)
    else:
        w = scale * (q.to(tl.int32) - OFFSET).to(tl.float32)
    if HAS_MIN:
        w = w + mn
    return w


@triton.jit
def _store_gemv(y, BIAS, OUT, offs_m, rows, m_mask, n_mask, split, s_op, s_om,
                HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr):  # fmt: skip
    """Store the GEMV's y (BLOCK_M, BLOCK_N) fp32: with DIRECT, plus the bias and in OUT's
    dtype; else as split `split`'s fp32 partials."""
    out_mask = m_mask[:, None] & n_mask[None, :]
    if DIRECT:
        if HAS_BIAS:
            y += tl.load(BIAS + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        o_ptr = OUT + offs_m.to(tl.int64)[:, None] * s_om + rows[None, :]
        tl.store(o_ptr, round_to(y, OUT.dtype.element_ty), mask=out_mask)
    else:
        o_ptr = OUT + split * s_op + offs_m.to(tl.int64)[:, None] * s_om + rows[None, :]
        tl.store(o_ptr, y, mask=out_mask)


@triton.jit
def _gemv_kernel(
    X,  # (M, K), last dim contiguous
    C,  # codes (N, K) int8, or (N, K / 2) uint8 when PACKED
    S,  # (N, groups) scales: fp16/fp32, or int8/uint8 sub-scales times D
    MN,  # (N, groups) minimums, when HAS_MIN: the same two kinds, with DMIN
    D,  # (N, K / SUPER) fp16, when SUPER
    DMIN,
    BIAS,  # (N,), when HAS_BIAS and DIRECT
    OUT,  # (M, N) in x's dtype when DIRECT; else fp32 partials (splits, M, N)
    M,
    N,
    K,
    split_len,  # columns per split, a multiple of BLOCK_K
    s_xm,
    s_c,
    s_s,
    s_m,
    s_d,
    s_dm,
    s_op,  # partials: stride between splits
    s_om,
    PACKED: tl.constexpr,
    GROUP: tl.constexpr,  # columns per scale; 0: one scale per row
    SUPER: tl.constexpr,  # columns per d (K-quants); 0: none
    OFFSET: tl.constexpr,
    HAS_MIN: tl.constexpr,
    FP8: tl.constexpr,  # codes are float8_e4m3fn bytes (uint8)
    MX: tl.constexpr,  # codes are e2m1 nibbles, scales e8m0 bytes (MXFP4)
    HAS_BIAS: tl.constexpr,
    DIRECT: tl.constexpr,
    SUB: tl.constexpr,  # columns of a tile, all in one group (see _weight_args)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    split = tl.program_id(1)
    n_mask = rows < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    x_rows = X + offs_m.to(tl.int64)[:, None] * s_xm
    xdt = X.dtype.element_ty
    HALVES: tl.constexpr = 2 if PACKED else 1  # codes per byte
    W: tl.constexpr = SUB // HALVES  # bytes of a group per row; its columns come in HALVES runs
    offs_w = tl.arange(0, W)
    # (M, N, W) products, summed over W once at the end: no reduction inside the loop
    acc = tl.zeros([BLOCK_M, BLOCK_N, W], tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, K)
    if GROUP == 0:  # one scale per row: read once
        scale, mn = _group_terms(S, MN, D, DMIN, rows, n_mask, 0, s_s, s_m, s_d, s_dm,
                                 GROUP, SUPER, HAS_MIN, MX)  # fmt: skip
    for k0 in range(start, end, BLOCK_K):
        for sub in tl.static_range(BLOCK_K // SUB):
            c0 = k0 + sub * SUB
            if GROUP > 0:  # past the end (codes and x masked), any group of the row will do
                scale, mn = _group_terms(S, MN, D, DMIN, rows, n_mask, tl.minimum(c0, end - 1),
                                         s_s, s_m, s_d, s_dm,
                                         GROUP, SUPER, HAS_MIN, MX)  # fmt: skip
            # packed: byte j holds column c0 + j (low nibble) and c0 + 16 + j (high nibble)
            mask = n_mask[:, None] & (c0 + offs_w < end)[None, :]
            raw = tl.load(C + rows[:, None] * s_c + (c0 // HALVES + offs_w)[None, :], mask=mask,
                          other=0)  # fmt: skip
            for half in tl.static_range(HALVES):
                q = raw
                if PACKED:
                    q = (raw >> (4 * half)) & 15
                w = _weights(q, scale[:, None], mn[:, None], OFFSET, HAS_MIN, FP8, MX)
                w = round_to(w, xdt).to(tl.float32)  # the reference's cast to x's dtype
                cols = c0 + half * W + offs_w
                x_mask = m_mask[:, None] & (cols < end)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=x_mask, other=0.0).to(tl.float32)
                acc += x[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2)  # (BLOCK_M, BLOCK_N)
    _store_gemv(y, BIAS, OUT, offs_m, rows, m_mask, n_mask, split, s_op, s_om, HAS_BIAS, DIRECT)


@triton.jit
def _split_sum_kernel(
    PART,  # (splits, M, N) fp32, contiguous
    BIAS,
    OUT,  # (M, N)
    N,
    n_splits,
    s_om,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """OUT[m] = sum of the splits' partials (in split order) + bias, rounded once."""
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    n_rows = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(n_splits):
        acc += tl.load(PART + (s * n_rows + m) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + m * s_om + offs, round_to(acc, OUT.dtype.element_ty), mask=mask)


@triton.jit
def _tiled_kernel(
    X,  # (M, K)
    C,
    S,
    MN,
    D,
    DMIN,
    BIAS,
    OUT,  # (M, N) in x's dtype
    M,
    N,
    K,
    s_xm,
    s_c,
    s_s,
    s_m,
    s_d,
    s_dm,
    s_om,
    PACKED: tl.constexpr,
    GROUP: tl.constexpr,
    SUPER: tl.constexpr,
    OFFSET: tl.constexpr,
    HAS_MIN: tl.constexpr,
    FP8: tl.constexpr,
    MX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    m_mask = offs_m < M
    n_mask = rows < N
    x_rows = X + offs_m[:, None] * s_xm
    xdt = X.dtype.element_ty
    HALVES: tl.constexpr = 2 if PACKED else 1
    W: tl.constexpr = SUB // HALVES
    offs_w = tl.arange(0, W)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if GROUP == 0:
        scale, mn = _group_terms(S, MN, D, DMIN, rows, n_mask, 0, s_s, s_m, s_d, s_dm,
                                 GROUP, SUPER, HAS_MIN, MX)  # fmt: skip
    for k0 in range(0, K, BLOCK_K):
        for sub in tl.static_range(BLOCK_K // SUB):  # tiles (W, BLOCK_N) of W.T, one scale each
            c0 = k0 + sub * SUB
            if GROUP > 0:
                scale, mn = _group_terms(S, MN, D, DMIN, rows, n_mask, tl.minimum(c0, K - 1),
                                         s_s, s_m, s_d, s_dm,
                                         GROUP, SUPER, HAS_MIN, MX)  # fmt: skip
            mask = (c0 + offs_w < K)[:, None] & n_mask[None, :]
            raw = tl.load(C + rows[None, :] * s_c + (c0 // HALVES + offs_w)[:, None], mask=mask,
                          other=0)  # fmt: skip
            for half in tl.static_range(HALVES):  # packed: one dot per nibble
                q = raw
                if PACKED:
                    q = (raw >> (4 * half)) & 15
                w = _weights(q, scale[None, :], mn[None, :], OFFSET, HAS_MIN, FP8, MX)
                cols = c0 + half * W + offs_w
                x_mask = m_mask[:, None] & (cols < K)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=x_mask, other=0.0)
                acc += mma(x, round_to(w, xdt))  # (BLOCK_M, W) @ (W, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(BIAS + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    o_ptr = OUT + offs_m[:, None] * s_om + rows[None, :]
    tl.store(o_ptr, round_to(acc, OUT.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # the interpreter: a couple of splits, to exercise the sum


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _check(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> None:
    op = "quant_linear"
    require(isinstance(w, QuantWeight), op, f"weight must be a QuantWeight, not {type(w)}")
    fmt, (n, k) = w.fmt, w.shape
    require(x.shape[-1] == k, op, f"x {tuple(x.shape)} vs weight {w.shape}")
    require(x.dtype in (torch.float32, torch.float16, torch.bfloat16), op, f"x is {x.dtype}")
    step = 1 if fmt.fp8 else max(fmt.group, fmt.superblock, 32 if fmt.packed else 1)
    require(k % step == 0, op, f"{fmt.name} needs in_features divisible by {step}, got {k}")
    if fmt.mx:  # e2m1 nibbles, e8m0 bytes
        got = f"{w.codes.dtype} {tuple(w.codes.shape)}, {w.scales.dtype} {tuple(w.scales.shape)}"
        ok = (w.codes.dtype, w.scales.dtype) == (torch.uint8, torch.uint8)
        ok = ok and (w.codes.shape, w.scales.shape) == ((n, k // 2), (n, k // 32))
        require(ok, op, f"mxfp4 codes / scales must be uint8 {(n, k // 2)} / {(n, k // 32)}, {got}")
    if fmt.fp8:  # partial edge groups: ceil(k / group) scales per row, exactly
        want = (n, triton.cdiv(k, fmt.group))
        got = f"{w.codes.dtype} {tuple(w.codes.shape)}"
        ok = w.codes.dtype == torch.uint8 and w.codes.shape == (n, k)
        require(ok, op, f"fp8 codes must be uint8 {(n, k)}, got {got}")
        require(tuple(w.scales.shape) == want, op, f"fp8 scales {tuple(w.scales.shape)} != {want}")
    for name in ("codes", "scales", "mins", "d", "dmin"):
        t = getattr(w, name)
        if t is not None:
            require(t.device == x.device, op, f"weight.{name} on {t.device}, x on {x.device}")
            require(t.stride(-1) == 1, op, f"weight.{name} must be contiguous in its last dim")
    if bias is not None:
        require(bias.shape == (n,), op, f"bias {tuple(bias.shape)} vs {n} output features")
        require(bias.device == x.device, op, f"bias on {bias.device}, x on {x.device}")


def _weight_args(w: QuantWeight) -> tuple[list, dict]:
    """The weight's tensors and row strides (unused ones replaced by the scales: a pointer that
    is never read) and its format as constexprs."""
    s = w.scales
    mins = w.mins if w.mins is not None else s
    d = w.d if w.d is not None else s
    dmin = w.dmin if w.dmin is not None else s
    tensors = [w.codes, s, mins, d, dmin]
    strides = [t.stride(0) for t in tensors]
    fmt = w.fmt
    consts = dict(
        PACKED=fmt.packed,
        GROUP=fmt.group,
        SUPER=fmt.superblock,
        OFFSET=fmt.offset,
        HAS_MIN=w.mins is not None,
        FP8=fmt.fp8,
        MX=fmt.mx,
        # tiles of up to 32 columns inside one group (fp8's 128-column groups: 4 tiles, each
        # loading its group's scale); per-row scales: 32
        SUB=math.gcd(fmt.group, 32) if fmt.group else 32,
    )
    return tensors + strides, consts


def quant_linear(
    x: torch.Tensor,
    weight: QuantWeight,
    bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """x (..., K) @ W.T + bias -> (..., N) in x's dtype, W a QuantWeight (N, K). Up to
    GEMV_ROWS rows take the split-K GEMV (`split_k` splits; default: enough programs for about
    four per SM), more the tiled kernel."""
    _check(x, weight, bias)
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    w_args, consts = _weight_args(weight)
    has_bias = bias is not None
    b = bias if has_bias else out
    if m > GEMV_ROWS:
        block_m = min(64, max(16, _p2(m)))
        # exact fp32 dots run on FMA units and hold more registers: half the N tile (a 64-wide
        # one spills at sm90)
        block_n, block_k = (32 if x.dtype == torch.float32 else 64), 64
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _tiled_kernel[grid](
            x2, *w_args[:5], b, out, m, n, k, x2.stride(0), *w_args[5:], out.stride(0),
            **consts, HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=4, num_stages=2,
        )  # fmt: skip
        return out.view(*lead, n)
    block_m = _p2(m)
    # tiles of 32 output features x 128 columns (64 from 5 rows: the (M, N, 32) accumulator
    # and the unrolled group loads of 8 rows spill at sm90 with triton 3.6)
    block_n, block_k = 32, (128 if block_m <= 4 else 64)
    n_blocks = triton.cdiv(n, block_n)
    if split_k is None:
        split_k = triton.cdiv(4 * _num_sms(x.device), n_blocks)
    split_k = max(1, min(split_k, triton.cdiv(k, block_k)))
    split_len = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, split_len)
    direct = split_k == 1
    part = out if direct else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _gemv_kernel[(n_blocks, split_k)](
        x2, *w_args[:5], b, part, m, n, k, split_len, x2.stride(0), *w_args[5:],
        part.stride(0), part.stride(-2), **consts, HAS_BIAS=has_bias, DIRECT=direct,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=2,
    )  # fmt: skip
    if not direct:
        block = min(1024, _p2(n))
        _split_sum_kernel[(m, triton.cdiv(n, block))](
            part, b, out, n, split_k, out.stride(0), HAS_BIAS=has_bias, BLOCK=block
        )
    return out.view(*lead, n)
