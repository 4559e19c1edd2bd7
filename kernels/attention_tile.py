"""The tile loop decode and prefill attention share: an online softmax over key tiles.

`attend` streams keys [lo, hi) of one kv head past a block of query rows (decode: the query
heads of a GQA group; prefill: query positions of one head) and returns the unnormalised
output with its running max and sum; each kernel adds its own sink, normalises and stores.
Scores live in the log2 domain (the softmax scale times log2(e) folded in, or the soft-cap's
factors), as `kernels.dispatch.softcap_factors` gives them.
"""

import triton
import triton.language as tl

from kernels.casting import mma, round_to, tanh


@triton.jit
def load_rows(base, rows, row_mask, width, BLOCK: tl.constexpr):
    """A (len(rows), BLOCK) tile: row r from base + rows[r], its first `width` columns (0 past
    them and in masked rows)."""
    offs = tl.arange(0, BLOCK)
    mask = row_mask[:, None] & (offs < width)[None, :]
    return tl.load(base + rows[:, None] + offs[None, :], mask=mask, other=0.0)


@triton.jit
def attend(
    q,  # (ROWS, BLOCK_D) query tile
    qpe,  # (ROWS, BLOCK_DPE) rope part of the queries, when HAS_PE (else any tensor)
    k_base,  # this row's kv head: key n at k_base + n * sk_s
    kpe_base,  # this row's rope keys: key n at kpe_base + n * skp_s, when HAS_PE
    v_base,  # this row's kv head's values: value n at v_base + n * sv_s; unread when V_IS_K
    lo,  # the first key read (tile-aligned or not)
    hi,  # the keys read end here
    n_end,  # keys at n >= n_end are masked (padding of the last tile)
    pos,  # (ROWS,) the queries' positions, when CAUSAL: key n is visible up to pos
    window,  # keys n > pos - window are visible, when CAUSAL and HAS_WINDOW
    keep_base,  # when HAS_KEEP: row r reads key n only if keep_base[rows_keep[r] + n] != 0
    rows_keep,  # (ROWS,) offsets of the rows' selections (decode: all 0, one query)
    rows_mask,  # (ROWS,) the real rows: padding rows read no selection
    sk_s,
    skp_s,
    sv_s,
    qk_scale,  # softmax scale * log2(e)
    cap_in,  # soft-cap: scores -> cap_out * tanh(cap_in * q.k)
    cap_out,
    D,
    DPE,
    DV,
    ROWS: tl.constexpr,
    HAS_PE: tl.constexpr,
    V_IS_K: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """-> (acc (ROWS, BLOCK_DV) fp32, m_i (ROWS,) running max, l_i (ROWS,) running sum)."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DV], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_end
        k = load_rows(k_base, offs_n * sk_s, n_mask, D, BLOCK_D)
        scores = mma(q, tl.trans(k))  # (ROWS, BLOCK_N) fp32
        if HAS_PE:
            kpe = load_rows(kpe_base, offs_n * skp_s, n_mask, DPE, BLOCK_DPE)
            scores += mma(qpe, tl.trans(kpe))
        if HAS_SOFTCAP:
            scores = cap_out * tanh(scores * cap_in)
        else:
            scores = scores * qk_scale
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= pos[:, None])
            if HAS_WINDOW:
                visible = visible & (offs_n[None, :] > pos[:, None] - window)
        if HAS_KEEP:  # DeepSeek sparse attention: only the selected keys (uint8, 1 = kept)
            sel = tl.load(
                keep_base + rows_keep[:, None] + offs_n[None, :],
                mask=rows_mask[:, None] & n_mask[None, :],
                other=0,
            )
            visible = visible & (sel != 0)
        scores = tl.where(visible, scores, float("-inf"))
        # a window or a selection may hide a whole tile from a row: keep its maximum finite
        # (no inf - inf)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_IS_K:
            v = k
        else:
            v = load_rows(v_base, offs_n * sv_s, n_mask, DV, BLOCK_DV)
        p = round_to(p, v_base.dtype.element_ty)  # P in V's dtype, as flash kernels do
        acc = acc * alpha[:, None] + mma(p, v)
        m_i = m_new
    return acc, m_i, l_i
