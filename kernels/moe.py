"""Routed MoE experts: tokens sorted by expert, then two grouped GEMMs (fused-MoE style).

Routing (router logits -> top-k ids and weights) stays in the caller: it is an (N, E) softmax
and top-k, tiny next to the experts. This op takes the top-k assignment and
1. sorts the N*K (token, slot) pairs by expert and pads each expert's run to BLOCK_M rows, all
   with device ops (no host sync, so decode stays graph-capturable); the grid is the static
   upper bound cdiv(N*K, BLOCK_M) + E blocks, and blocks past the last expert exit at once;
2. gate_up GEMM: block i gathers its BLOCK_M token rows of x and multiplies them by its
   expert's (2I, H) weight (+ its bias) -> (N*K, 2I);
3. SwiGLU (silu_mul.py), or gpt-oss's clamped SwiGLU over interleaved rows (torch, elementwise:
   `reference.clamped_swiglu`) -> (N*K, I);
4. down GEMM (+ its bias), scaled by each pair's routing weight -> (N*K, H) fp32; summed over k
   per token.
Each expert's weights are read once per block of its tokens, not once per token. Either weight
may be a `QuantExperts`, widened in registers tile by tile: fp8 (FP8) or MXFP4 (MX: e2m1 codes
two per byte, column j of a 32-column group in byte j's low nibble and j + 16 in its high one,
times 2^(e - 128) of the group's e8m0 byte), each the reference's weights bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.casting import e2m1_doubled, e8m0_half, mma, round_to
from kernels.dispatch import interpreting, kernel_module, require
from kernels.qweight import QuantExperts
from kernels.reference import clamped_swiglu

INTERPRETED = interpreting()
_silu_mul = kernel_module("kernels.silu_mul")  # via dispatch: re-decorated if stale


@triton.jit
def _grouped_gemm_kernel(
    A,  # (rows, Kdim): x (rows indexed by pair // a_div) or the per-pair activations
    W,  # (E, Nout, Kdim): floats, or fp8 codes (uint8) when FP8; (E, Nout, Kdim / 2) when MX
    S,  # (E, Nout, cdiv(Kdim, GROUP)) fp32 scales when FP8, e8m0 (uint8) when MX
    C,  # (N*K, Nout), row per (token, slot) pair
    SORTED,  # (n_blocks * BLOCK_M,) pair ids grouped by expert; n_pairs marks padding
    BLOCK_EXPERT,  # (n_blocks,) the expert of each block; >= n_experts: unused block
    PAIR_W,  # (N*K,) routing weights, when MUL_WEIGHT
    BIAS,  # (E, Nout) per-expert biases, when HAS_BIAS
    n_pairs,
    n_experts,
    n_out,
    k_dim,
    a_div,
    s_am,
    s_we,
    s_wn,
    s_se,
    s_sn,
    s_cm,
    s_be,
    MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP8: tl.constexpr,  # W holds float8_e4m3fn bytes, times S's scale of their (row, k-group)
    MX: tl.constexpr,  # W holds e2m1 codes (two per byte), S e8m0 exponents: MXFP4
    GROUP: tl.constexpr,  # columns per scale, when FP8 or MX
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(BLOCK_EXPERT + pid_m)
    if expert >= n_experts:
        return
    pairs = tl.load(SORTED + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < n_pairs
    a_rows = (pairs // a_div).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = A + a_rows[:, None] * s_am + offs_k[None, :]
    w_ptr = W + expert.to(tl.int64) * s_we + offs_n[None, :] * s_wn
    s_ptr = S + expert.to(tl.int64) * s_se + offs_n[None, :] * s_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        cols = k0 + offs_k
        k_mask = cols < k_dim
        w_mask = k_mask[:, None] & n_mask[None, :]
        a = tl.load(a_ptr + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        at = cols
        if MX:  # the byte holding each column (columns j and j + 16 of a group share one)
            at = cols // 32 * 16 + cols % 16
        w = tl.load(w_ptr + at[:, None], mask=w_mask, other=0)  # masked: 0, never a NaN
        if FP8:  # float32(e4m3) * scale, rounded to x's dtype: the reference's weights
            scale = tl.load(s_ptr + (cols // GROUP)[:, None], mask=w_mask, other=0.0)
            w = round_to(w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale, a.dtype)
        if MX:  # 2^(e - 128) * E2M1[code], rounded to x's dtype: the reference's weights
            scale = e8m0_half(tl.load(s_ptr + (cols // GROUP)[:, None], mask=w_mask, other=0))
            q = (w >> (cols // 16 % 2 * 4).to(tl.uint8)[:, None]) & 15
            w = round_to(scale * e2m1_doubled(q), a.dtype)
        acc += mma(a, w)  # (BLOCK_M, BLOCK_K) @ (BLOCK_K, BLOCK_N)
    if HAS_BIAS:  # before the routing weight, as the reference adds it
        b = tl.load(BIAS + expert.to(tl.int64) * s_be + offs_n, mask=n_mask, other=0.0)
        acc += b.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(PAIR_W + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    c_ptr = C + pairs.to(tl.int64)[:, None] * s_cm + offs_n[None, :]
    tl.store(c_ptr, round_to(acc, C.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def sort_by_expert(topk_ids: torch.Tensor, n_experts: int, block_m: int):
    """Group the N*K (token, slot) pairs by expert, each expert's run padded to block_m.

    Returns (sorted_pairs (n_blocks * block_m,) int32 with N*K as padding, block_expert
    (n_blocks,) int32 with n_experts for unused blocks). Device ops only: no host sync.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    n_pairs, dev = flat.numel(), flat.device
    n_blocks = triton.cdiv(n_pairs, block_m) + n_experts  # static upper bound
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # pair ids, grouped by expert
    expert_of = flat[order]
    rank = torch.arange(n_pairs, device=dev) - (counts.cumsum(0) - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank
    sorted_pairs = torch.full((n_blocks * block_m,), n_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(n_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_pairs, block_expert


def _grouped_gemm(a, w, out, sorted_pairs, block_expert, pair_w, bias, a_div, block_m):
    n_out, k_dim = w.shape[1], w.shape[2]
    block_n, block_k = 64, 64
    grid = (block_expert.numel(), triton.cdiv(n_out, block_n))
    quant = isinstance(w, QuantExperts)
    fp8, mx = quant and w.fmt.fp8, quant and w.fmt.mx
    group = w.fmt.group if quant else 0
    w, s = (w.codes, w.scales) if quant else (w, w)  # s: never read for floats
    _grouped_gemm_kernel[grid](
        a,
        w,
        s,
        out,
        sorted_pairs,
        block_expert,
        pair_w if pair_w is not None else out,
        bias if bias is not None else out,
        out.shape[0],
        w.shape[0],
        n_out,
        k_dim,
        a_div,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        s.stride(0),
        s.stride(1),
        out.stride(0),
        bias.stride(0) if bias is not None else 0,
        MUL_WEIGHT=pair_w is not None,
        HAS_BIAS=bias is not None,
        FP8=fp8,
        MX=mx,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        num_stages=2,
    )


def _check_quant(w: QuantExperts, name: str) -> None:
    e, n, k = w.shape
    mx = w.fmt.mx
    kind = "mxfp4" if mx else "fp8"
    want = (e, n, k // 32) if mx else (e, n, triton.cdiv(k, w.fmt.group))
    got = (w.codes.dtype, tuple(w.codes.shape))
    op, scales = "moe_experts", (tuple(w.scales.shape), w.scales.dtype)
    s_dtype = torch.uint8 if mx else torch.float32
    if mx:
        require(k % 32 == 0, op, f"{name}: mxfp4 needs in_features divisible by 32, got {k}")
    require(got == (torch.uint8, (e, n, k // 2 if mx else k)), op, f"{name}: {kind} codes {got}")
    require(scales == (want, s_dtype), op, f"{name}: {kind} scales {scales}, want {want} {s_dtype}")
    require(w.codes.is_contiguous() and w.scales.is_contiguous(), op, f"{name}: not contiguous")


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    clamp: tuple[float, float] | None = None,
) -> torch.Tensor:
    """sum_k w[n,k] * down[e] @ swiglu(gate_up[e] @ x[n]) with e = ids[n,k].

    x (N, H); topk_ids (N, K) int; topk_weights (N, K); gate_up (E, 2I, H) stacked [gate | up];
    down (E, H, I). Either weight may be a `QuantExperts` (fp8 codes + fp32 scales per row and
    k-group, or MXFP4 codes + e8m0 scales): the GEMM widens each tile in registers (W8A16,
    W4A16). Optional biases gate_up_bias (E, 2I), down_bias (E, H) and `clamp` = (alpha,
    limit): gpt-oss's clamped SwiGLU over interleaved rows (see the reference). Returns (N, H)
    in x's dtype.
    """
    op = "moe_experts"
    require(x.ndim == 2 and topk_ids.ndim == 2, op, "x must be (N, H) and topk_ids (N, K)")
    n, h = x.shape
    n_topk = topk_ids.shape[1]
    e, two_i, h_w = gate_up.shape
    require(topk_ids.shape[0] == n, op, f"topk_ids {tuple(topk_ids.shape)} vs x {tuple(x.shape)}")
    require(topk_weights.shape == topk_ids.shape, op, "topk_weights and topk_ids differ in shape")
    require(
        not topk_ids.is_floating_point(), op, f"topk_ids must be integers, not {topk_ids.dtype}"
    )
    require(h_w == h and two_i % 2 == 0, op, f"gate_up {tuple(gate_up.shape)} vs hidden {h}")
    require(
        down.shape == (e, h, two_i // 2), op, f"down {tuple(down.shape)} != {(e, h, two_i // 2)}"
    )
    for name, t in (("gate_up", gate_up), ("down", down)):
        require(t.dtype == x.dtype, op, f"{name} is {t.dtype}, x is {x.dtype}")
        require(t.device == x.device, op, f"{name} on {t.device}, x on {x.device}")
        if isinstance(t, QuantExperts):
            _check_quant(t, name)
    for name, b, rows in (("gate_up_bias", gate_up_bias, two_i), ("down_bias", down_bias, h)):
        if b is not None:
            require(b.shape == (e, rows), op, f"{name} {tuple(b.shape)} != {(e, rows)}")
            require(b.device == x.device, op, f"{name} on {b.device}, x on {x.device}")
    if n == 0 or n_topk == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_up, down = (w if isinstance(w, QuantExperts) else w.contiguous() for w in (gate_up, down))
    pairs = n * n_topk
    # rows per block: about the mean number of tokens an expert receives, at least 16 (tl.dot)
    block_m = min(64, max(16, triton.next_power_of_2(triton.cdiv(pairs, e))))
    sorted_pairs, block_expert = sort_by_expert(topk_ids, e, block_m)
    if INTERPRETED:  # the interpreter: a host sync is free, empty blocks are not
        block_expert = block_expert[: int((block_expert < e).sum())]
    h1 = torch.empty(pairs, two_i, dtype=x.dtype, device=x.device)
    biases = (gate_up_bias, down_bias)
    gate_up_bias, down_bias = (b if b is None else b.contiguous() for b in biases)
    _grouped_gemm(x, gate_up, h1, sorted_pairs, block_expert, None, gate_up_bias, n_topk, block_m)
    act = _silu_mul.swiglu(h1) if clamp is None else clamped_swiglu(h1, *clamp)  # (N*K, I)
    h2 = torch.empty(pairs, h, dtype=torch.float32, device=x.device)
    pair_w = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(act, down, h2, sorted_pairs, block_expert, pair_w, down_bias, 1, block_m)
    return h2.view(n, n_topk, h).sum(dim=1).to(x.dtype)
