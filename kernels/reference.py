"""Torch references of every kernel op: the ground truth the Triton kernels are tested against,
and the path taken on CPUs. Shapes use B batch, T new tokens, S cached tokens, H heads, D dims."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, accumulated in fp32, returned in x's dtype.

    Rounds like transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h), h) with h = x + residual in x's dtype: the pre-norm block's residual add
    fused with the next norm. Returns (normed, new_residual)."""
    h = x + residual
    return rms_norm(h, weight, eps), h


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first 2*cos.shape[-1] dims of q (B, Hq, T, D) and k (B, Hk, T, D).

    cos, sin: (B or 1, T, R/2) in fp32. Half-split layout pairs dim i with i + R/2 (Llama);
    interleaved pairs 2i with 2i+1 (DeepSeek). Dims past R pass through unchanged.
    """
    c = cos[:, None].to(q.dtype)
    s = sin[:, None].to(q.dtype)
    return _rotate(q, c, s, interleaved), _rotate(k, c, s, interleaved)


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, interleaved: bool) -> torch.Tensor:
    r = 2 * c.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((out, rest), dim=-1) if rest.numel() else out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where gate_up (..., 2I) holds [gate | up] along its last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _visible(
    start_pos: int | torch.Tensor, t: int, s: int, device, window: int | None = None
) -> torch.Tensor | None:
    """Causal mask: query t at position start_pos + t sees cache positions <= its own, and
    with a window only the last `window` of them (positions > its own - window).

    (T, S) for an int start_pos, (B, 1, T, S) for a per-row (B,) tensor; None for one token at
    an int start_pos without a window, which sees the whole cache slice it is given.
    """
    if isinstance(start_pos, torch.Tensor):
        pos_q = start_pos.to(device).view(-1, 1, 1, 1) + torch.arange(t, device=device)[:, None]
        pos_k = torch.arange(s, device=device)
    else:
        if t == 1 and (window is None or s <= window):
            return None
        pos_q = torch.arange(start_pos, start_pos + t, device=device)[:, None]
        pos_k = torch.arange(s, device=device)[None, :]
    visible = pos_k <= pos_q
    if window is not None:
        visible = visible & (pos_k > pos_q - window)
    return visible


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start_pos: int | torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of q (B, Hq, T, D) over the cache k, v (B, Hkv, S, D).

    Query t of row b sits at position start_pos + t (start_pos an int, or a (B,) tensor of
    per-row positions) and sees cached positions <= its own; S >= max(start_pos) + T.
    window: only positions > its own - window (the token and window - 1 before it);
    softcap: scores (after `scale`) -> softcap * tanh(scores / softcap); sinks (Hq,): one more
    logit per head in each softmax, attending to nothing (as gpt-oss).
    Returns (B, Hq, T, Dv).
    """
    plain = softcap is None and sinks is None
    if plain and not (q.shape[2] == 1 and torch.is_tensor(start_pos) and _compiling()):
        mask = _visible(start_pos, q.shape[2], k.shape[2], q.device, window)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    return _attention_math(q, k, v, start_pos, scale, window, softcap, sinks)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _attention_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start_pos: int | torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention as plain matmuls and a masked softmax (fp32 scores), for what SDPA lacks
    (soft-capping, sinks). Inside a compiled decode step inductor fuses these into the step's
    own loops, which beats a call into SDPA's kernel per layer; eager, SDPA is the cheaper
    path."""
    b, hq, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, hk, hq // hk * t, d)  # query heads grouped by the kv head they share
    scores = (qg.float() @ k.float().transpose(-1, -2)) * scale  # (B, Hk, G*T, S)
    scores = scores.view(b, hq, t, s)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = _visible(start_pos, t, s, q.device, window)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # one more column per head, dropped after the softmax
        sink = sinks.float().view(1, hq, 1, 1).expand(b, hq, t, 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :s]
    else:
        probs = scores.softmax(dim=-1)
    probs = probs.view(b, hk, hq // hk * t, s).to(v.dtype)
    return (probs @ v).view(b, hq, t, v.shape[-1])


def mla_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    start_pos: int | torch.Tensor,
    scale: float,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multi-head latent attention over the compressed cache, with kv_b_proj absorbed.

    q_lat (B, H, T, R): the no-rope query already multiplied into the latent space (q_nope @ W_uk);
    q_pe (B, H, T, Dr): the roped query part; latent (B, S, R) and k_pe (B, S, Dr): the cache,
    shared by all heads, S >= max(start_pos) + T (start_pos: an int or per-row (B,) tensor).
    keep (B, T, S) bool: the only keys each query may read besides causality (DeepSeek sparse
    attention's top-k selection); None: every earlier key.
    Returns (B, H, T, R): softmax(scores) @ latent, which the caller maps to values with W_uv.
    """
    t, s = q_lat.shape[2], latent.shape[1]
    scores = torch.einsum("bhtr,bsr->bhts", q_lat.float(), latent.float())
    scores = scores + torch.einsum("bhtd,bsd->bhts", q_pe.float(), k_pe.float())
    scores = scores * scale
    visible = _visible(start_pos, t, s, q_lat.device)
    if keep is not None:
        visible = keep[:, None] if visible is None else visible & keep[:, None]
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhts,bsr->bhtr", probs, latent.float()).to(q_lat.dtype)


def sparse_mla_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    start_pos: int | torch.Tensor,
    scale: float,
    keep: torch.Tensor,
) -> torch.Tensor:
    """`mla_attention` restricted to the keys keep (B, T, S) bool marks (DeepSeek sparse
    attention): the op `kernels.sparse_mla_attention` dispatches."""
    return mla_attention(q_lat, q_pe, latent, k_pe, start_pos, scale, keep)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: gate_up (..., 2I) holds interleaved (gate, up) pairs; gate is
    clamped to <= limit, up to [-limit, limit]; (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


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
    """Routed SwiGLU experts: sum_k w[n,k] * expert[ids[n,k]](x[n]).

    x (N, H); topk_ids (N, K) int; topk_weights (N, K); gate_up (E, 2I, H) stacked [gate | up];
    down (E, H, I). Optional per-expert biases gate_up_bias (E, 2I), down_bias (E, H); `clamp`
    = (alpha, limit) makes the activation `clamped_swiglu` over interleaved (gate, up) rows
    (gpt-oss). Either weight may be a `QuantExperts` (fp8 or MXFP4 kept): each expert that runs is
    dequantized to float32, then cast to x's dtype; or a `BlockExperts` (GGML blocks kept on
    CPUs): each expert that runs is a `kernels.linear` of its blocks. Returns (N, H) in x's
    dtype. Loops over the experts that received tokens.
    """
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = _times(x[token], gate_up, e)
        if gate_up_bias is not None:
            h = h + gate_up_bias[e]
        h = swiglu(h) if clamp is None else clamped_swiglu(h, *clamp)
        h = _times(h, down, e)
        if down_bias is not None:
            h = h + down_bias[e]
        out.index_add_(0, token, h * topk_weights[token, slot, None].to(x.dtype))
    return out


def _times(h: torch.Tensor, w, e: int) -> torch.Tensor:
    """h @ expert e's (out, in) matrix of stacked weights: a tensor, a `QuantExperts`
    (dequantized) or a `BlockExperts` (GGML blocks on CPUs: `kernels.linear` of its weight)."""
    if isinstance(w, torch.Tensor):
        return h @ w[e].T
    if hasattr(w, "experts"):  # BlockExperts
        from kernels.dispatch import linear

        return linear(h, w[e])
    return h @ w.dequantize(e).to(h.dtype).T


def quant_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias for a `kernels.qweight.QuantWeight` W: the whole weight dequantized to
    float32 (bit-exact with the `gguf` package), cast to x's dtype, then F.linear."""
    return F.linear(x, weight.dequantize().to(x.dtype), bias)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    chunk: int = 64,
) -> torch.Tensor:
    """The gated delta rule (gated DeltaNet's linear attention), per row and value head:

        S_t = exp(g_t) S_{t-1} + k_t u_t^T,  u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
        o_t = scale * S_t^T q_t

    q, k (B, T, Hk, Dk), already L2-normed; v (B, T, Hv, Dv), value head j reading key head
    j // (Hv / Hk); g (log decay, <= 0) and beta (B, T, Hv) fp32; state (B, Hv, Dk, Dv) fp32:
    the state before the first token, overwritten in place with the one after the last.
    A token with g = 0 and beta = 0 leaves the state as it is (padding). Returns o (B, T, Hv,
    Dv) in v's dtype. One token: the recurrent step; more: `chunk` tokens at a time.
    """
    rep = v.shape[2] // k.shape[2]
    # (B, Hv, T, D) fp32, key heads repeated for the value heads they serve
    q, k = (x.repeat_interleave(rep, dim=2).transpose(1, 2).float() for x in (q, k))
    q = q * scale
    vv = v.transpose(1, 2).float()
    g, beta = g.transpose(1, 2).float(), beta.transpose(1, 2).float()  # (B, Hv, T)
    if q.shape[2] == 1:
        o = _delta_step(q[:, :, 0], k[:, :, 0], vv[:, :, 0], g[..., 0], beta[..., 0], state)
        return o[:, None].to(v.dtype)
    return _delta_chunked(q, k, vv, g, beta, state, chunk).transpose(1, 2).to(v.dtype)


def _delta_step(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token: q, k (B, H, Dk), v (B, H, Dv), g, beta (B, H); state updated in place."""
    s = state * g.exp()[..., None, None]
    u = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", s, k))
    s = s + k[..., :, None] * u[..., None, :]
    state.copy_(s)
    return torch.einsum("bhkv,bhk->bhv", s, q)  # (B, H, Dv)


def _delta_chunked(q, k, v, g, beta, state: torch.Tensor, c: int) -> torch.Tensor:
    """T tokens in chunks of c (B, H, T, D layout). Within a chunk, with G_i the cumulative log
    decay and S0 the state before it, the new values u solve the unit lower-triangular system
    (I + A) U = beta V - beta exp(G) K S0, A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i); then
    o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) u_j and
    S = exp(G_c) S0 + sum_j exp(G_c - G_j) k_j u_j^T. Returns (B, H, T, Dv)."""
    b, h, t, _ = k.shape
    pad = -t % c  # padded tokens: g = beta = 0 (k = 0 too), so they change nothing
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // c
    q, k, v = (x.view(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    gc = g.view(b, h, n, c).cumsum(-1)  # (B, H, N, C)
    beta = beta.view(b, h, n, c, 1)
    causal = torch.ones(c, c, dtype=torch.bool, device=k.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    a = ((beta * k) @ k.transpose(-1, -2) * decay).tril(-1)  # (B, H, N, C, C)
    eye = torch.eye(c, device=k.device)
    w_v = torch.linalg.solve_triangular(eye + a, beta * v, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(
        eye + a, beta * k * gc.exp()[..., None], upper=False, unitriangular=True
    )
    attn = q @ k.transpose(-1, -2) * decay  # (B, H, N, C, C), lower triangle with diagonal
    q_decayed = q * gc.exp()[..., None]
    k_to_end = k * (gc[..., -1:] - gc).exp()[..., None]
    s = state
    out = torch.empty_like(v)
    for i in range(n):
        u = w_v[:, :, i] - w_k[:, :, i] @ s  # (B, H, C, Dv)
        out[:, :, i] = q_decayed[:, :, i] @ s + attn[:, :, i] @ u
        s = s * gc[:, :, i, -1].exp()[..., None, None] + k_to_end[:, :, i].transpose(-1, -2) @ u
    state.copy_(s)
    return out.view(b, h, n * c, -1)[:, :, :t]


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    bm: torch.Tensor,
    cm: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> torch.Tensor:
    """Mamba2's state-space scan (SSD) without the D skip, per row and head h (reading group
    h // (H / G)):

        h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,  y_t = h_t C_t

    x (B, T, H, P); dt (B, T, H) fp32, softplus'd and clamped (0 on padding: that token leaves
    the state as it is); A (H,) fp32 (-exp(A_log)); B, C (B, T, G, N); state (B, H, P, N)
    fp32, overwritten in place with the state after the last token. Returns y (B, T, H, P)
    fp32. One token: the recurrent step; more: `chunk` tokens at a time.
    """
    rep = x.shape[2] // bm.shape[2]
    bm, cm = (m.repeat_interleave(rep, dim=2).float() for m in (bm, cm))  # (B, T, H, N)
    xs = x.float() * dt[..., None]  # dt_t x_t: (B, T, H, P)
    la = dt.float() * a  # log decay per token: (B, T, H)
    if x.shape[1] == 1:
        s = state * la[:, 0].exp()[..., None, None] + xs[:, 0, ..., None] * bm[:, 0, :, None]
        state.copy_(s)
        return torch.einsum("bhpn,bhn->bhp", s, cm[:, 0])[:, None]
    return _ssd_chunked(xs, la, bm, cm, state, chunk)


def _ssd_chunked(xs, la, bm, cm, state: torch.Tensor, c: int) -> torch.Tensor:
    """T tokens in chunks of c. Within a chunk, with L_i the cumulative log decay and S0 the
    state before it: y_i = exp(L_i) S0 C_i + sum_{j<=i} exp(L_i - L_j) (C_i.B_j) xs_j, and
    the state after it is exp(L_c) S0 + sum_j exp(L_c - L_j) xs_j B_j^T. Returns (B, T, H, P)."""
    b, t, h, p = xs.shape
    pad = -t % c  # padded tokens: dt = 0, so they neither decay nor add to the state
    xs, bm, cm = (F.pad(m, (0, 0, 0, 0, 0, pad)) for m in (xs, bm, cm))
    n = (t + pad) // c
    # (B, H, N, C, ...): heads first, then chunks, then the positions inside a chunk
    xs, bm, cm = (m.view(b, n, c, h, -1).permute(0, 3, 1, 2, 4) for m in (xs, bm, cm))
    lc = F.pad(la, (0, 0, 0, pad)).view(b, n, c, h).permute(0, 3, 1, 2).cumsum(-1)
    causal = torch.ones(c, c, dtype=torch.bool, device=xs.device).tril()
    decay = (lc[..., :, None] - lc[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    y_in = (cm @ bm.transpose(-1, -2) * decay) @ xs  # inside each chunk: (B, H, N, C, P)
    c_decayed = cm * lc.exp()[..., None]  # C_i exp(L_i): reads the state before the chunk
    b_to_end = bm * (lc[..., -1:] - lc).exp()[..., None]  # B_j exp(L_c - L_j)
    s = state
    y = torch.empty_like(xs)
    for i in range(n):
        y[:, :, i] = y_in[:, :, i] + c_decayed[:, :, i] @ s.transpose(-1, -2)
        s = (
            s * lc[:, :, i, -1].exp()[..., None, None]
            + xs[:, :, i].transpose(-1, -2) @ b_to_end[:, :, i]
        )
    state.copy_(s)
    return y.permute(0, 2, 3, 1, 4).reshape(b, n * c, h, p)[:, :t]
