"""Prefill attention: causal flash attention of T new tokens over the static cache, with GQA.

Program (query block, b * Hq + h) streams the keys its block can see, [0, start_pos + last
query], through an online softmax; query t sits at position start_pos + t. Query head h reads
kv head h // (Hq / Hkv); the group's programs hit the same K/V tiles in L2.

MLA prefill is the same kernel with one kv "head" (the latent cache, read once as both K and V)
and an extra rope score term (q_pe . k_pe), as in decode_attention.py; DeepSeek sparse attention
adds a key selection (`keep` (B, T, S)) that masks the scores of the keys it leaves out.

Whether this kernel or torch SDPA (cuDNN / FlashAttention-2 backends) is faster at prefill is
pending a GPU measurement (benchmarks/kernels.py; see docs/kernels.md).
"""

from __future__ import annotations

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
def _block_keys(pid_m, start_pos, n_kv, window, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """[lo, hi): the keys query block pid_m may see (causal, and inside the window)."""
    hi = tl.minimum(n_kv, start_pos + (pid_m + 1) * BLOCK_M)  # keys past the block's last query
    lo = 0
    if HAS_WINDOW:  # keys before the block's first query's window: skipped, tile-aligned
        lo = tl.maximum(start_pos + pid_m * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    return lo, hi


@triton.jit
def _store_rows(acc, m_i, l_i, SINK, o_rows, m_mask, DV, HAS_SINKS: tl.constexpr,
                BLOCK_DV: tl.constexpr):  # fmt: skip
    """Normalise acc (BLOCK_M, BLOCK_DV), with its running max m_i and sum l_i (and the sink
    at SINK, when HAS_SINKS), and store row r at o_rows[r] where m_mask."""
    if HAS_SINKS:  # the sink joins the denominator only (log2 domain, like the scores)
        sink = tl.load(SINK).to(tl.float32) * 1.4426950408889634
        l_i += tl.exp2(sink - m_i)
    # (a query row past T may see no key: 0, not 0/0; it is not stored)
    offs_dv = tl.arange(0, BLOCK_DV)
    out = round_to(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], o_rows.dtype.element_ty)
    tl.store(
        o_rows[:, None] + offs_dv[None, :], out, mask=m_mask[:, None] & (offs_dv < DV)[None, :]
    )


@triton.jit
def _prefill_kernel(
    Q,  # (B, Hq, T, D)
    QPE,  # (B, Hq, T, DPE), when HAS_PE
    K,  # (B, Hkv, S, D)
    KPE,  # (B, S, DPE), when HAS_PE
    V,  # (B, Hkv, S, DV); ignored when V_IS_K
    OUT,  # (B, Hq, T, DV)
    STARTS,  # (B,) int32 per-row start positions, when PER_ROW
    SINKS,  # (Hq,) per-head sink logits, when HAS_SINKS
    KEEP,  # (B, T, S) uint8 key selection (1 = read), last dim contiguous, when HAS_KEEP
    sq_b,
    sq_h,
    sq_t,
    sqp_b,
    sqp_h,
    sqp_t,
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
    so_t,
    skeep_b,
    skeep_t,
    n_heads,
    group,
    n_q,
    n_kv,
    start_pos,
    qk_scale,  # softmax scale * log2(e)
    window,  # keys > query position - window are visible, when HAS_WINDOW
    cap_in,  # soft-cap: scores -> cap_out * tanh(cap_in * q.k), scale and log2(e) folded in
    cap_out,
    D,
    DPE,
    DV,
    HAS_PE: tl.constexpr,
    V_IS_K: tl.constexpr,
    PER_ROW: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = (tl.program_id(1) // n_heads).to(tl.int64)
    h = tl.program_id(1) % n_heads
    kvh = h // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < n_q
    if PER_ROW:
        start_pos = tl.load(STARTS + b)
    pos = start_pos + offs_m  # (BLOCK_M,) absolute positions of the queries
    q = load_rows(Q + b * sq_b + h * sq_h, offs_m * sq_t, m_mask, D, BLOCK_D)
    qpe = q  # unread without HAS_PE
    if HAS_PE:
        qpe = load_rows(QPE + b * sqp_b + h * sqp_h, offs_m * sqp_t, m_mask, DPE, BLOCK_DPE)
    lo, hi = _block_keys(pid_m, start_pos, n_kv, window, HAS_WINDOW, BLOCK_M, BLOCK_N)
    acc, m_i, l_i = attend(
        q, qpe, K + b * sk_b + kvh * sk_h, KPE + b * skp_b, V + b * sv_b + kvh * sv_h,
        lo, hi, n_kv, pos, window, KEEP + b * skeep_b, offs_m * skeep_t, m_mask,
        sk_s, skp_s, sv_s, qk_scale, cap_in, cap_out, D, DPE, DV,
        BLOCK_M, HAS_PE, V_IS_K, True, HAS_WINDOW, HAS_SOFTCAP, HAS_KEEP,  # CAUSAL: yes
        BLOCK_N, BLOCK_D, BLOCK_DPE, BLOCK_DV,
    )  # fmt: skip
    o_rows = OUT + b * so_b + h * so_h + offs_m * so_t
    _store_rows(acc, m_i, l_i, SINKS + h, o_rows, m_mask, DV, HAS_SINKS, BLOCK_DV)


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _starts(op, start_pos, q, s: int):
    """start_pos as the kernel takes it: a (B,) int32 tensor of per-row positions, or None for
    one int (then checked: the cache holds its T queries)."""
    bsz, _, t, _ = q.shape
    if isinstance(start_pos, torch.Tensor):
        require(start_pos.shape == (bsz,), op, f"start_pos {tuple(start_pos.shape)} != ({bsz},)")
        return start_pos.to(device=q.device, dtype=torch.int32)
    require(s >= start_pos + t, op, f"cache holds {s} positions < start_pos {start_pos} + T {t}")
    return None


def _tiles(dtype: torch.dtype, d: int, dv: int) -> tuple[int, int, bool]:
    """(block_m, block_n, wide): queries and keys per tile; wide: MLA's wide latent tiles."""
    wide = _p2(d) + _p2(dv) > 256  # MLA's 512-wide latent: smaller tiles fit in registers
    block_m, block_n = (32, 32) if wide else (64, 64)
    if dtype == torch.float32:  # exact fp32 dots run on FMA units, and twice the registers
        block_m, block_n = block_m // 2, block_n // 2
    if INTERPRETED:  # small tiles exercise the block edges and the causal diagonal on tiny tests
        block_m, block_n = 16, 16
    return block_m, block_n, wide


def _run_kernel(
    q, qpe, k, kpe, v, out, start_pos, starts, scale, window, softcap, sinks, keep=None
) -> None:
    """The kernel over q (B, Hq, T, D) into out (B, Hq, T, DV): starts, per-row positions, or
    None and the int start_pos; keep, None or a (B, T, S) uint8 key selection."""
    bsz, hq, t, d = q.shape
    dv = out.shape[3]
    block_m, block_n, wide = _tiles(q.dtype, d, dv)
    block_d, block_dv = _p2(d), _p2(dv)
    has_pe = qpe is not None
    qpe_ = qpe if has_pe else q
    kpe_ = kpe if has_pe else k
    v_ = k if v is None else v
    _prefill_kernel[(triton.cdiv(t, block_m), bsz * hq)](
        q,
        qpe_,
        k,
        kpe_,
        v_,
        out,
        starts if starts is not None else out,  # a dummy pointer when unused
        sinks if sinks is not None else out,
        keep if keep is not None else out,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        qpe_.stride(0),
        qpe_.stride(1),
        qpe_.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        kpe_.stride(0),
        kpe_.stride(-2),
        v_.stride(0),
        v_.stride(1),
        v_.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        keep.stride(0) if keep is not None else 0,
        keep.stride(1) if keep is not None else 0,
        hq,
        hq // k.shape[1],
        t,
        k.shape[2],
        0 if starts is not None else start_pos,
        scale * LOG2E,
        window or 0,
        *softcap_factors(scale, softcap),
        d,
        qpe_.shape[-1],
        dv,
        HAS_PE=has_pe,
        V_IS_K=v is None,
        PER_ROW=starts is not None,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        HAS_KEEP=keep is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DPE=_p2(qpe_.shape[-1]) if has_pe else 16,
        BLOCK_DV=block_dv,
        num_warps=4 if not wide else 8,
        num_stages=2,
    )


def _launch(
    q, qpe, k, kpe, v, start_pos, scale, op, window=None, softcap=None, sinks=None, keep=None
):
    """q (B, Hq, T, D), k (B, Hkv, S, D), v (B, Hkv, S, DV) or None (= k) -> (B, Hq, T, DV);
    keep: None, or a (B, T, S) uint8 key selection (1: the query reads that key).

    start_pos: an int, or a (B,) tensor of per-row positions (then S >= max + T is the
    caller's to ensure: checking it would cost a device sync)."""
    bsz, hq, t, _ = q.shape
    dv = k.shape[3] if v is None else v.shape[3]
    check_operands(op, q, qpe, k, kpe, v)
    starts = _starts(op, start_pos, q, k.shape[2])
    check_features(op, hq, q.device, window, softcap, sinks)
    out = torch.empty(bsz, hq, t, dv, dtype=q.dtype, device=q.device)
    if bsz * t == 0:
        return out
    _run_kernel(q, qpe, k, kpe, v, out, start_pos, starts, scale, window, softcap, sinks, keep)
    return out


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start_pos: int | torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of q (B, Hq, T, D) over the cache k, v (B', Hkv, S, D/Dv), B' >= B.

    Query t of row b sits at position start_pos + t (an int, or a (B,) tensor of per-row
    positions) and sees cache positions <= its own; with `window`, only the last `window` of
    them. softcap, sinks: as `kernels.reference.attention`.
    Returns (B, Hq, T, Dv) in q's dtype.
    """
    op = "attention (prefill)"
    require(q.ndim == 4 and k.ndim == 4 and v.ndim == 4, op, "q, k, v must be (B, H, T|S, D)")
    require(k.shape[:3] == v.shape[:3], op, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    return _launch(q, None, k, None, v, start_pos, scale, op, window, softcap, sinks)


def mla_prefill_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    start_pos: int | torch.Tensor,
    scale: float,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal absorbed MLA: q_lat (B, H, T, R), q_pe (B, H, T, Dr) over latent (B', S, R) and
    k_pe (B', S, Dr) -> (B, H, T, R) = softmax(scale * (q_lat.latent + q_pe.k_pe)) @ latent.
    keep (B, T, S) bool: the keys each query may read besides causality (DeepSeek sparse
    attention's selection); a query that keeps none of its keys gets 0 (the reference: NaN)."""
    op = "mla_attention (prefill)"
    require(q_lat.ndim == 4 and q_pe.shape[:3] == q_lat.shape[:3], op, "q_lat, q_pe shapes")
    require(latent.ndim == 3 and k_pe.ndim == 3, op, "latent, k_pe must be (B, S, R), (B, S, Dr)")
    require(latent.shape[:2] == k_pe.shape[:2], op, f"latent {latent.shape} vs k_pe {k_pe.shape}")
    require(k_pe.shape[2] == q_pe.shape[3], op, f"k_pe {k_pe.shape} vs q_pe {q_pe.shape}")
    sel = check_keep(op, keep, q_lat, latent.shape[1])
    return _launch(q_lat, q_pe, latent[:, None], k_pe, None, start_pos, scale, op, keep=sel)
