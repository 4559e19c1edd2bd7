"""Decode attention (one new token per row) over the static cache: split-K flash-decoding.

Stage 1: program (b, kv-head x query-head block, split) scores the query heads that share one kv
head against its slice of the cache, so K/V are read once per group (GQA: any Hq/Hkv ratio);
the query heads sit in the M dim of a tensor-core tile (padded to 16). It writes an unnormalised
partial output and its log-sum-exp. Stage 2 merges the splits. Splits let a single sequence fill
the GPU; per-row lengths (`seq_lens`) leave a row's tail of the cache unread.

MLA is the same kernel with one kv "head" (the latent cache, read once as both K and V) and an
extra rope score term (q_pe . k_pe); DeepSeek sparse attention adds a key selection (`keep`) that
masks the scores of the keys it leaves out (their tiles are still read).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.attention_tile import attend, load_rows
from kernels.casting import round_to
from kernels.dispatch import (
    check_features,
    check_keep,
    check_operands,
    interpreting,
    require,
    softcap_factors,
)

INTERPRETED = interpreting()
LOG2E = 1.4426950408889634


@triton.jit
def _split_keys(LENS, b, split, seq_len, split_len, window, HAS_LENS: tl.constexpr,
                HAS_WINDOW: tl.constexpr):  # fmt: skip
    """[start, end): the keys of row b that split `split` reads (empty past the row's length)."""
    length = seq_len
    if HAS_LENS:
        length = tl.load(LENS + b)
    start = split * split_len
    end = tl.minimum(start + split_len, length)
    if HAS_WINDOW:  # the query sits at length - 1: keys before its window are not read
        start = tl.maximum(start, length - window)
    return start, end


@triton.jit
def _store_split(acc, m_i, l_i, SINKS, O_PART, LSE_PART, b, heads, g_mask, split, so_b, so_h,
                 so_s, sl_b, sl_h, DV, DIRECT: tl.constexpr, HAS_SINKS: tl.constexpr,
                 BLOCK_DV: tl.constexpr):  # fmt: skip
    """Normalise a split's output acc (BLOCK_G, BLOCK_DV) of the query heads `heads` (those
    in g_mask), with its running max m_i and sum l_i, and store it with its log-sum-exp; with
    DIRECT (one split) store the output itself, its sink joined to the denominator."""
    if DIRECT and HAS_SINKS:  # one split: the sink joins the denominator here (log2 domain)
        sink = tl.load(SINKS + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i += tl.exp2(sink - m_i)
    # an empty split (past this row's length) leaves l_i = 0: write 0 and lse = -inf
    offs_dv = tl.arange(0, BLOCK_DV)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptr = O_PART + b * so_b + heads[:, None] * so_h + split * so_s + offs_dv[None, :]
    out = round_to(out, O_PART.dtype.element_ty)  # fp32 partials, or the final dtype
    tl.store(o_ptr, out, mask=g_mask[:, None] & (offs_dv < DV)[None, :])
    if not DIRECT:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(LSE_PART + b * sl_b + heads * sl_h + split, lse, mask=g_mask)


@triton.jit
def _decode_split_kernel(
    Q,  # (B, Hq, D) view
    QPE,  # (B, Hq, DPE), when HAS_PE
    K,  # (B, Hkv, S, D)
    KPE,  # (B, S, DPE), when HAS_PE
    V,  # (B, Hkv, S, DV); ignored when V_IS_K
    LENS,  # (B,) int32, when HAS_LENS
    SINKS,  # (Hq,) per-head sink logits, when HAS_SINKS (read here only when DIRECT)
    KEEP,  # (B, S) uint8 key selection (1 = read), last dim contiguous, when HAS_KEEP
    O_PART,  # (B, Hq, NS, DV) fp32; with DIRECT (one split) the output (B, Hq, DV) itself
    LSE_PART,  # (B, Hq, NS) fp32, log2 domain; unused with DIRECT
    sq_b,
    sq_h,
    sqp_b,
    sqp_h,
    sk_b,
    sk_h,
    sk_s,
    skp_b,
    skp_s,
    sv_b,
    sv_h,
    sv_s,
    so_b,
    so_h,
    so_s,
    sl_b,
    sl_h,
    skeep_b,
    group,  # query heads per kv head
    n_gblocks,  # cdiv(group, BLOCK_G)
    seq_len,
    split_len,
    qk_scale,  # softmax scale * log2(e)
    window,  # the last `window` positions are visible, when HAS_WINDOW
    cap_in,  # soft-cap: scores -> cap_out * tanh(cap_in * q.k), scale and log2(e) folded in
    cap_out,
    D,
    DPE,
    DV,
    HAS_PE: tl.constexpr,
    HAS_LENS: tl.constexpr,
    V_IS_K: tl.constexpr,
    DIRECT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1) // n_gblocks
    g = (tl.program_id(1) % n_gblocks) * BLOCK_G + tl.arange(0, BLOCK_G)
    split = tl.program_id(2)
    g_mask = g < group
    heads = kvh * group + g  # (BLOCK_G,) query heads
    start, end = _split_keys(LENS, b, split, seq_len, split_len, window, HAS_LENS, HAS_WINDOW)
    q = load_rows(Q + b * sq_b, heads * sq_h, g_mask, D, BLOCK_D)
    qpe = q  # unread without HAS_PE
    if HAS_PE:
        qpe = load_rows(QPE + b * sqp_b, heads * sqp_h, g_mask, DPE, BLOCK_DPE)
    # keys [start, end) are all visible: the query sits at length - 1, past the window's start;
    # with a selection (one query: one row of it for every head), only the selected ones
    acc, m_i, l_i = attend(
        q, qpe, K + b * sk_b + kvh * sk_h, KPE + b * skp_b, V + b * sv_b + kvh * sv_h,
        start, end, end, g, window, KEEP + b * skeep_b, tl.zeros_like(g), g_mask,
        sk_s, skp_s, sv_s, qk_scale, cap_in, cap_out, D, DPE, DV,
        BLOCK_G, HAS_PE, V_IS_K, False, HAS_WINDOW, HAS_SOFTCAP, HAS_KEEP,  # CAUSAL: no
        BLOCK_N, BLOCK_D, BLOCK_DPE, BLOCK_DV,
    )  # fmt: skip
    _store_split(
        acc, m_i, l_i, SINKS, O_PART, LSE_PART, b, heads, g_mask, split,
        so_b, so_h, so_s, sl_b, sl_h, DV, DIRECT, HAS_SINKS, BLOCK_DV,
    )  # fmt: skip


@triton.jit
def _decode_merge_kernel(
    O_PART,
    LSE_PART,
    SINKS,  # (Hq,) per-head sink logits, when HAS_SINKS
    OUT,  # (B, Hq, DV) view
    n_heads,
    n_splits,
    so_b,
    so_h,
    so_s,
    sl_b,
    sl_h,
    sout_b,
    sout_h,
    DV,
    HAS_SINKS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    b = (tl.program_id(0) // n_heads).to(tl.int64)
    h = tl.program_id(0) % n_heads
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_mask = offs_s < n_splits
    lse = tl.load(LSE_PART + b * sl_b + h * sl_h + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: output 0, not NaN
    w = tl.exp2(lse - m)  # (BLOCK_S,)
    o = tl.load(
        O_PART + b * so_b + h * so_h + offs_s[:, None] * so_s + offs_dv[None, :],
        mask=s_mask[:, None] & (offs_dv < DV)[None, :],
        other=0.0,
    )
    den = tl.sum(w, axis=0)
    if HAS_SINKS:  # the sink's share of the softmax: in the denominator, attending to nothing
        den += tl.exp2(tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634 - m)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(
        OUT + b * sout_b + h * sout_h + offs_dv,
        round_to(out, OUT.dtype.element_ty),
        mask=offs_dv < DV,
    )


def _num_sms(device: torch.device) -> int:
    """The GPU's SM count (torch caches the properties; an lru_cache here would make dynamo warn
    in every compiled decode step)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits, to exercise the merge


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


class _Tiling(NamedTuple):
    """How stage 1 cuts the work: query heads per tile and tiles per GQA group, keys per tile,
    and the cache cut into num_splits splits of split_len keys (a multiple of block_n)."""

    block_g: int
    n_gblocks: int
    block_n: int
    num_splits: int
    split_len: int


def _tiling(q, hkv: int, s: int, dv: int, num_splits: int | None) -> _Tiling:
    """The tiling of q (B, Hq, D) over a cache of hkv heads, s positions and values dv wide
    (num_splits: the splits asked for, or None: enough for the GPU)."""
    bsz, hq, d = q.shape
    group = hq // hkv
    # query heads fill the tile's M dim (>= 16 for tl.dot); wide latent values get small tiles
    block_g = max(16, min(_p2(group), 64 if _p2(dv) <= 128 else 16))
    n_gblocks = triton.cdiv(group, block_g)
    block_n = 64 if _p2(d) <= 128 else 32
    if q.dtype == torch.float32:  # exact fp32 dots: twice the registers per element
        block_n //= 2
    if num_splits is None:  # enough programs for ~2 waves of the GPU
        num_splits = triton.cdiv(2 * _num_sms(q.device), bsz * hkv * n_gblocks)
    num_splits = max(1, min(num_splits, triton.cdiv(s, block_n), 128))
    split_len = triton.cdiv(triton.cdiv(s, num_splits), block_n) * block_n
    return _Tiling(block_g, n_gblocks, block_n, triton.cdiv(s, split_len), split_len)


def _split_stage(
    q,
    qpe,
    k,
    kpe,
    v,
    seq_lens,
    sinks,
    o_part,
    lse_part,
    scale,
    window,
    softcap,
    tiling: _Tiling,
    keep=None,
):
    """Stage 1: each split's partial output (and log-sum-exp) into o_part (and lse_part);
    with one split, the output itself. keep: None, or a (B, S) uint8 key selection."""
    block_g, n_gblocks, block_n, num_splits, split_len = tiling
    hkv, s = k.shape[1], k.shape[2]
    dv = k.shape[3] if v is None else v.shape[3]
    lens = seq_lens if seq_lens is not None else o_part  # a dummy pointer when unused
    sinks_ = sinks if sinks is not None else o_part
    has_pe = qpe is not None
    qpe_ = qpe if has_pe else q
    kpe_ = kpe if has_pe else k
    v_ = k if v is None else v
    _decode_split_kernel[(q.shape[0], hkv * n_gblocks, num_splits)](
        q,
        qpe_,
        k,
        kpe_,
        v_,
        lens,
        sinks_,
        keep if keep is not None else o_part,
        o_part,
        lse_part,
        q.stride(0),
        q.stride(1),
        qpe_.stride(0),
        qpe_.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        kpe_.stride(0),
        kpe_.stride(-2),
        v_.stride(0),
        v_.stride(1),
        v_.stride(2),
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse_part.stride(0),
        lse_part.stride(1),
        keep.stride(0) if keep is not None else 0,
        q.shape[1] // hkv,
        n_gblocks,
        s,
        split_len,
        scale * LOG2E,
        window or 0,
        *softcap_factors(scale, softcap),
        q.shape[2],
        qpe_.shape[-1],
        dv,
        HAS_PE=has_pe,
        HAS_LENS=seq_lens is not None,
        V_IS_K=v is None,
        DIRECT=num_splits == 1,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        HAS_KEEP=keep is not None,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        BLOCK_D=_p2(q.shape[2]),
        BLOCK_DPE=_p2(qpe_.shape[-1]) if has_pe else 16,
        BLOCK_DV=_p2(dv),
        num_warps=4,
        num_stages=2,
    )


def _merge_stage(o_part, lse_part, sinks, out) -> None:
    """Stage 2: out (B, Hq, DV) = the splits' partials, each weighted by its share of the
    softmax (and the sink's share in the denominator)."""
    bsz, hq, num_splits, dv = o_part.shape
    _decode_merge_kernel[(bsz * hq,)](
        o_part,
        lse_part,
        sinks if sinks is not None else o_part,
        out,
        hq,
        num_splits,
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse_part.stride(0),
        lse_part.stride(1),
        out.stride(0),
        out.stride(1),
        dv,
        HAS_SINKS=sinks is not None,
        BLOCK_S=_p2(num_splits),
        BLOCK_DV=_p2(dv),
        num_warps=4,
    )


def _launch(
    q,
    qpe,
    k,
    kpe,
    v,
    seq_lens,
    scale,
    num_splits,
    op,
    window=None,
    softcap=None,
    sinks=None,
    keep=None,
):
    """q (B, Hq, D), k (B, Hkv, S, D), v (B, Hkv, S, DV) or None (= k) -> (B, Hq, DV);
    keep: None, or a (B, S) uint8 key selection (1: the row reads that key)."""
    bsz, hq, _ = q.shape
    hkv, s = k.shape[1], k.shape[2]
    dv = k.shape[3] if v is None else v.shape[3]
    check_operands(op, q, qpe, k, kpe, v)
    check_features(op, hq, q.device, window, softcap, sinks)
    out = torch.empty(bsz, hq, 1, dv, dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    tiling = _tiling(q, hkv, s, dv, num_splits)
    num_splits = tiling.num_splits
    direct = num_splits == 1  # one split: stage 1 writes the output, no merge launch
    o3 = out.view(bsz, hq, dv)
    if direct:
        o_part, lse_part = o3[:, :, None], o3[:, :, 0]  # strides only; lse is not written
    else:
        o_part = torch.empty(bsz, hq, num_splits, dv, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device)
    _split_stage(
        q, qpe, k, kpe, v, seq_lens, sinks, o_part, lse_part, scale, window, softcap, tiling, keep
    )
    if not direct:
        _merge_stage(o_part, lse_part, sinks, o3)
    return out


def _check_lens(seq_lens, q, op):
    if seq_lens is None:
        return None
    bsz = q.shape[0]
    require(
        seq_lens.shape == (bsz,) and not seq_lens.is_floating_point(),
        op,
        f"seq_lens must be ({bsz},) integers, got {tuple(seq_lens.shape)} {seq_lens.dtype}",
    )
    # lengths past the cache (> S) are the caller's bug: checking would cost a device sync
    return seq_lens.to(device=q.device, dtype=torch.int32)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None = None,
    num_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, Hq, 1, D) over the cache k, v (B', Hkv, S, D/Dv) with B' >= B -> (B, Hq, 1, Dv).

    Row b sees cache positions [0, seq_lens[b]) (default: all S), with `window` only the last
    `window` of them (positions [len - window, len): no split reads below that). The query
    sits at the last visible position, so no causal mask is needed. softcap, sinks: as
    `kernels.reference.attention`.
    """
    op = "attention (decode)"
    require(q.ndim == 4 and q.shape[2] == 1, op, f"q {tuple(q.shape)} must be (B, Hq, 1, D)")
    require(k.ndim == 4 and v.ndim == 4, op, "k and v must be (B, Hkv, S, D)")
    require(k.shape[:3] == v.shape[:3], op, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    lens = _check_lens(seq_lens, q, op)
    return _launch(
        q[:, :, 0], None, k, None, v, lens, scale, num_splits, op, window, softcap, sinks
    )


def mla_decode_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None = None,
    num_splits: int | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_lat (B, H, 1, R), q_pe (B, H, 1, Dr) over latent (B', S, R), k_pe (B', S, Dr).

    Returns (B, H, 1, R) = softmax(scale * (q_lat.latent + q_pe.k_pe)) @ latent; each latent
    tile is read once and serves as both key and value. keep (B, 1, S) bool: the keys each
    row may read besides its length (DeepSeek sparse attention's selection); the others are
    masked out of the scores. A row that keeps none of its keys gets 0 (the reference: NaN).
    """
    op = "mla_attention (decode)"
    require(q_lat.ndim == 4 and q_lat.shape[2] == 1, op, f"q_lat {tuple(q_lat.shape)}: T != 1")
    require(q_pe.shape[:3] == q_lat.shape[:3], op, f"q_pe {tuple(q_pe.shape)} vs q_lat")
    require(latent.ndim == 3 and k_pe.ndim == 3, op, "latent, k_pe must be (B, S, R), (B, S, Dr)")
    require(latent.shape[:2] == k_pe.shape[:2], op, f"latent {latent.shape} vs k_pe {k_pe.shape}")
    require(k_pe.shape[2] == q_pe.shape[3], op, f"k_pe {k_pe.shape} vs q_pe {q_pe.shape}")
    lens = _check_lens(seq_lens, q_lat, op)
    sel = check_keep(op, keep, q_lat, latent.shape[1])
    return _launch(
        q_lat[:, :, 0],
        q_pe[:, :, 0],
        latent[:, None],  # one kv head shared by all query heads
        k_pe,
        None,
        lens,
        scale,
        num_splits,
        op,
        keep=None if sel is None else sel[:, 0],
    )
