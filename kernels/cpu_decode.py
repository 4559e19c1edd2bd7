"""A decode step's decoder blocks as one C call on CPUs (kernels/cpu_decode.c, cpu_moe.c).

For a few rows (one token per sequence) of a small model, an eager step spends more time
dispatching its ~20 ops per block and forking and joining threads for each product than in
the products themselves: SmolLM2-135M's 121 products took 5.0 ms of an 11.8 ms step. The C
function runs every block of the plain pre-norm kind (RMSNorm, GQA attention over the static
cache with rope, optional q/k norms and output gate, DeepSeek's MLA over its latent cache
(cpu_mla.c) or a gated DeltaNet layer (cpu_delta.c); a gated SiLU / GELU MLP or a MoE (cpu_moe.c:
any routing of core.layers.moe.route, SiLU-gated or gpt-oss's clamped experts, biases, shared
experts); Gemma's post-norms; quantized or fp32 weights) inside one OpenMP region, with the
arithmetic of the separate ops. `Blocks` holds the C view of the blocks' tensors (built once:
the tensors must stay where they are, which it checks by identity) and runs it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.blocks import BlockWeight
from kernels.cpu_quant import MAX_ROWS, QWeightView, library
from kernels.qweight import QuantStack

MAX_PARTS = 4  # as cpu_step.h
ACTS = {"silu": 0, "gelu_tanh": 1}
_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [("part", QWeightView * MAX_PARTS), ("parts", _i64), ("N", _i64), ("bias", _ptr)]


class _Block(ctypes.Structure):
    _fields_ = [
        ("norm1", _ptr), ("norm2", _ptr), ("eps1", _f32), ("eps2", _f32),
        ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
        ("k", _ptr), ("v", _ptr),
        *((name, _i64) for name in ("ksb", "ksh", "kss", "vsb", "vsh", "vss", "slots", "ring",
                                    "hq", "hkv", "d", "rope", "half", "interleaved")),
        ("scale", _f32), ("softcap", _f32), ("sinks", _ptr), ("act", _i64), ("inter", _i64),
        ("kv_half", _i64), ("qnorm", _ptr), ("knorm", _ptr), ("qk_eps", _f32), ("moe", _ptr),
        ("delta", _ptr), ("ogate", _i64),
        ("post1", _ptr), ("post2", _ptr), ("post_eps1", _f32), ("post_eps2", _f32), ("mla", _ptr),
    ]  # fmt: skip


class _Moe(ctypes.Structure):  # cpu_step.h's zmoe_t
    _fields_ = [
        ("experts", _i64), ("topk", _i64), ("renorm", _i64), ("inter", _i64),
        ("router", _Linear), ("gate_up", _ptr), ("down", _ptr), ("scoring", _i64),
        ("method", _i64), ("groups", _i64), ("topk_groups", _i64), ("scale", _f32),
        ("correction", _ptr), ("gate_up_bias", _ptr), ("down_bias", _ptr), ("glu", _i64),
        ("alpha", _f32), ("limit", _f32), ("shared_inter", _i64), ("shared_act", _i64),
        ("shared_gate_up", _Linear), ("shared_down", _Linear), ("shared_gate", _Linear),
    ]  # fmt: skip


SCORINGS = {"softmax": 0, "sigmoid": 1}
TOPK_METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}
MAX_EXPERTS = 1024  # as cpu_step.h


class _Delta(ctypes.Structure):  # cpu_step.h's zdelta_t
    _fields_ = [
        ("in_proj", _Linear), ("out_proj", _Linear),
        *((name, _i64) for name in ("hk", "hv", "dk", "dv", "kernel", "grouped")),
        ("conv_w", _ptr), ("neg_a", _ptr), ("dt_bias", _ptr), ("norm", _ptr), ("eps", _f32),
        ("conv", _ptr), ("state", _ptr), ("conv_sb", _i64), ("state_sb", _i64),
        ("conv_half", _i64), ("scratch", _ptr),
    ]  # fmt: skip


class _Mla(ctypes.Structure):  # cpu_step.h's zmla_t
    _fields_ = [
        *((name, _i64) for name in ("heads", "rank", "dn", "dr", "dv", "q_rank")),
        ("q", _Linear), ("q_a", _Linear), ("kv_a", _Linear), ("q_norm", _ptr), ("kv_norm", _ptr),
        ("q_eps", _f32), ("kv_eps", _f32), ("scale", _f32), ("kv_b", _ptr),
        ("latent", _ptr), ("k_pe", _ptr),
        *((name, _i64) for name in ("lsb", "lss", "psb", "pss", "half", "rope_half",
                                    "interleaved")),
    ]  # fmt: skip


class _Head(ctypes.Structure):
    _fields_ = [("norm", _ptr), ("eps", _f32), ("head", _Linear)]


@dataclass
class Block:
    """One decoder block's tensors and shape, as the C step reads them. Weights: fp32 (N, K)
    tensors or `BlockWeight` / `QuantStack`; caches (B, Hkv, S, D) fp32 or fp16 (a ring of S
    slots when `ring`); `rope`: index of the step's cos/sin table, None for a layer without
    rope. An MLA block (`mla`) has no qkv nor k / v caches (None), and heads = kv_heads,
    head_dim = its v_head_dim."""

    norm1: torch.Tensor
    eps1: float
    norm2: torch.Tensor
    eps2: float
    qkv: object | None
    qkv_bias: torch.Tensor | None
    o: object
    o_bias: torch.Tensor | None
    gate_up: object
    gate_up_bias: torch.Tensor | None
    down: object
    down_bias: torch.Tensor | None
    k_cache: torch.Tensor | None
    v_cache: torch.Tensor | None
    ring: bool
    heads: int
    kv_heads: int
    head_dim: int
    rope: int | None
    rope_half: int
    interleaved: bool
    scale: float
    softcap: float | None
    sinks: torch.Tensor | None
    act: str
    intermediate: int
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None  # q's, k's weight, eps
    moe: Experts | None = None  # in place of gate_up / down
    delta: Delta | None = None  # in place of attention (its fields then NO_ATTENTION's)
    output_gate: bool = False  # qkv's q rows are [q_h | gate_h] per head: o_h *= sigmoid(gate_h)
    # (attention's, the MLP's) output RMSNorm (weight, eps) before each residual add, or None
    post_norms: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None = None
    mla: Latent | None = None  # in place of qkv and the k / v caches


@dataclass
class Experts:
    """A MoE MLP the C step takes, as core.layers.moe.MoE computes it: `scoring` ("softmax" |
    "sigmoid") of `router` (E, H) fp32 logits (+ `router_bias`), the top `top_k` experts by
    `method` ("greedy" | "group_limited_greedy" | "noaux_tc": within the best `topk_groups` of
    `groups`, by score + `correction`), their weights renormalised where `renorm`, times
    `scale`; each expert a SiLU-gated MLP of `intermediate` rows, its gate|up (E, 2I, H) and
    down (E, H, I) fp32 tensors or `BlockExperts` of one format, with optional biases (E, 2I),
    (E, H); `clamp` (alpha, limit): gpt-oss's clamped SwiGLU over interleaved (gate, up) rows.
    `shared`: the always-on shared experts, added after the routed ones."""

    router: torch.Tensor
    top_k: int
    renorm: bool
    intermediate: int
    gate_up: object
    down: object
    router_bias: torch.Tensor | None = None
    scoring: str = "softmax"
    method: str = "greedy"
    groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0
    correction: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    clamp: tuple[float, float] | None = None
    shared: SharedExperts | None = None


@dataclass
class SharedExperts:
    """A MoE's always-on gated MLP of `intermediate` rows (gate_up [gate | up] (2S, H), down
    (H, S), optional biases, act "silu" | "gelu_tanh"), its output times sigmoid(x . gate)
    where `gate` (1, H) is given (Qwen3-Next)."""

    gate_up: object
    gate_up_bias: torch.Tensor | None
    down: object
    down_bias: torch.Tensor | None
    intermediate: int
    act: str = "silu"
    gate: object = None


@dataclass
class Delta:
    """A gated DeltaNet layer the C step takes in place of attention (cpu_delta.c): in_proj
    (its rows q|k|v|z|b|a, or `grouped` per key head as Qwen3-Next stores them) and out_proj,
    fp32 or `BlockWeight` / `QuantStack`; the conv's filters (conv_dim, K), -exp(A_log) and
    dt_bias (Hv,), the gated RMSNorm's weight (Dv,) and eps, all fp32; its cache: the conv
    window (B, conv_dim, K - 1) fp32 or fp16 and the state (B, Hv, Dk, Dv) fp32."""

    in_proj: object
    grouped: bool
    out_proj: object
    conv: torch.Tensor
    neg_a: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    eps: float
    conv_state: torch.Tensor
    state: torch.Tensor
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int


# a Block's attention fields where its layer is not attention (`delta`)
NO_ATTENTION = dict(
    qkv=None, qkv_bias=None, o=None, o_bias=None, k_cache=None, v_cache=None, ring=False,
    heads=0, kv_heads=0, head_dim=0, rope=None, rope_half=0, interleaved=False, scale=0.0,
    softcap=None, sinks=None,
)  # fmt: skip
DELTA_MAX_DIM = 512  # as cpu_step.h


@dataclass
class Latent:
    """An MLA attention the C step takes (cpu_step.h's zmla_t): q = q(x), or q(rms_norm(q_a(x)))
    where `q_a` is given; kv_a(x) = [latent (rank) | k_pe (rope)]; kv_b (heads (nope + v), rank)
    fp32, absorbed; caches latent (B, S, rank) and k_pe (B, S, rope), fp32 or fp16. Weights fp32
    or `BlockWeight`; norms: (weight, eps)."""

    heads: int
    rank: int
    nope: int
    rope: int
    v: int
    q: object
    q_a: object | None
    q_a_bias: torch.Tensor | None
    q_norm: tuple[torch.Tensor, float] | None
    kv_a: object
    kv_a_bias: torch.Tensor | None
    kv_norm: tuple[torch.Tensor, float]
    kv_b: torch.Tensor
    latent: torch.Tensor
    k_pe: torch.Tensor
    scale: float


def _float(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


def _parts(weight) -> list[QWeightView] | None:
    """The C views of a weight's parts, or None where the C step cannot take it."""
    if isinstance(weight, QuantStack):
        views = [_parts(p) for p in weight.parts]
        return None if any(v is None for v in views) else [x for v in views for x in v]
    if isinstance(weight, BlockWeight):
        return [weight.c_view()]
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and _float(weight):
        return [QWeightView(weight.data_ptr(), *weight.shape, 0)]
    return None


def _linear(weight, bias: torch.Tensor | None, keep: list) -> _Linear | None:
    parts = _parts(weight)
    if parts is None or len(parts) > MAX_PARTS or not _float(bias):
        return None
    keep.append((weight, bias))
    out = _Linear(parts=len(parts), N=sum(p.N for p in parts), bias=_addr(bias))
    for i, p in enumerate(parts):
        out.part[i] = p
    return out


def _experts(w, rows: int, cols: int) -> ctypes.Array | None:
    """The C views of stacked experts' weights (E of them, each (rows, cols)), or None."""
    if isinstance(w, torch.Tensor):
        if w.dim() != 3 or w.shape[1:] != (rows, cols) or not _float(w):
            return None
        step = rows * cols * 4
        views = [QWeightView(w.data_ptr() + e * step, rows, cols, 0) for e in range(w.shape[0])]
    else:
        parts = [_parts(x) for x in getattr(w, "experts", [None])]  # a BlockExperts' weights
        if any(p is None or len(p) != 1 for p in parts):
            return None
        views = [p[0] for p in parts]
        if {(v.N, v.K, v.type) for v in views} != {(rows, cols, views[0].type)}:
            return None
    return (QWeightView * len(views))(*views)


def _routing(m: Experts, keep: list) -> _Moe | None:
    """The routing fields of m's zmoe_t (None where the C step cannot take them)."""
    e = m.router.shape[0]
    vectors = (m.router_bias, m.correction)
    router = _linear(m.router, m.router_bias, keep) if _float(m.router) else None
    groups_ok = m.method == "greedy" or (e % m.groups == 0 and 0 < m.topk_groups <= m.groups)
    if (router is None or not all(v is None or (_float(v) and v.shape == (e,)) for v in vectors)
            or m.scoring not in SCORINGS or m.method not in TOPK_METHODS or not groups_ok
            or not 0 < m.top_k <= min(e, 64) or e > MAX_EXPERTS):  # fmt: skip
        return None
    keep.append(vectors)
    return _Moe(
        experts=e, topk=m.top_k, renorm=m.renorm, router=router, scoring=SCORINGS[m.scoring],
        method=TOPK_METHODS[m.method], groups=m.groups, topk_groups=m.topk_groups,
        scale=m.scale, correction=_addr(m.correction),
    )  # fmt: skip


def _shared(c: _Moe, s: SharedExperts, hidden: int, keep: list) -> bool:
    """Fill c's shared experts' fields from s; False where the C step cannot take them."""
    gate_up, down = _linear(s.gate_up, s.gate_up_bias, keep), _linear(s.down, s.down_bias, keep)
    gate = None if s.gate is None else _linear(s.gate, None, keep)
    want = [(gate_up, 2 * s.intermediate), (down, hidden), *[(gate, 1)] * (s.gate is not None)]
    if any(lin is None or n != lin.N for lin, n in want) or s.act not in ACTS:
        return False
    c.shared_inter, c.shared_act = s.intermediate, ACTS[s.act]
    c.shared_gate_up, c.shared_down = gate_up, down
    if gate is not None:
        c.shared_gate = gate
    return True


def _moe(c, b: Block, hidden: int, keep: list) -> bool:
    """Fill c's MoE fields from b.moe; False where the C step cannot take it."""
    m, i = b.moe, b.moe.intermediate
    e = _routing(m, keep)
    gate_up, down = _experts(m.gate_up, 2 * i, hidden), _experts(m.down, hidden, i)
    biases = ((m.gate_up_bias, 2 * i), (m.down_bias, hidden))
    if e is None or gate_up is None or down is None:
        return False
    if not len(gate_up) == len(down) == e.experts:
        return False
    if not all(x is None or (_float(x) and x.shape == (e.experts, n)) for x, n in biases):
        return False
    if m.shared is not None and not _shared(e, m.shared, hidden, keep):
        return False
    e.inter, e.gate_up, e.down = i, ctypes.addressof(gate_up), ctypes.addressof(down)
    e.gate_up_bias, e.down_bias = _addr(m.gate_up_bias), _addr(m.down_bias)
    e.glu, (e.alpha, e.limit) = m.clamp is not None, m.clamp or (0.0, 0.0)
    keep.append((m.gate_up, m.down, gate_up, down, m.gate_up_bias, m.down_bias, e))
    c.moe = ctypes.addressof(e)
    return True


def moe_route(m: Experts, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The C step's routing of logits (N, E) fp32 by m's method alone: (ids (N, K) int64,
    weights (N, K) fp32), or None where it does not take m."""
    keep: list = []
    c = _routing(m, keep)
    if c is None or library() is None:
        return None
    logits = logits.float().contiguous()
    ids = torch.empty(logits.shape[0], m.top_k, dtype=torch.int64)
    weights = torch.empty(logits.shape[0], m.top_k)
    library().zoo_moe_route(
        ctypes.byref(c), logits.data_ptr(), logits.shape[0], ids.data_ptr(), weights.data_ptr()
    )
    return ids, weights


def _cache_ok(t: torch.Tensor, dims: int, half: bool) -> bool:
    return (
        t.dim() == dims and t.stride(-1) == 1 and t.device.type == "cpu"
        and t.dtype == (torch.float16 if half else torch.float32)
    )  # fmt: skip


def _gqa(c, b: Block, keep: list) -> bool:
    """Fill c's GQA attention fields (q|k|v, the caches, q/k norms); False where the C step
    cannot take them."""
    qkv, d = _linear(b.qkv, b.qkv_bias, keep), b.head_dim
    half = b.k_cache.dtype == torch.float16
    if qkv is None or ((2 if b.output_gate else 1) * b.heads + 2 * b.kv_heads) * d != qkv.N:
        return False
    if not (_cache_ok(b.k_cache, 4, half) and _cache_ok(b.v_cache, 4, half)):
        return False
    if b.qk_norm is not None:
        qn, kn, eps = b.qk_norm
        if not (_float(qn) and _float(kn) and qn.shape == kn.shape == (d,)):
            return False
        keep.append((qn, kn))
        c.qnorm, c.knorm, c.qk_eps = qn.data_ptr(), kn.data_ptr(), eps
    keep.append((b.k_cache, b.v_cache))
    c.qkv = qkv
    c.k, c.v = b.k_cache.data_ptr(), b.v_cache.data_ptr()
    c.ksb, c.ksh, c.kss = b.k_cache.stride()[:3]
    c.vsb, c.vsh, c.vss = b.v_cache.stride()[:3]
    c.slots, c.ring, c.kv_half = b.k_cache.shape[2], b.ring, half
    return True


def _attention(c, b: Block, hidden: int, keep: list) -> bool:
    """Fill c's attention fields from b (GQA or `mla`, then o); False where the C step cannot
    take them."""
    if not (_gqa(c, b, keep) if b.mla is None else _mla(c, b, hidden, keep)):
        return False
    o = _linear(b.o, b.o_bias, keep)
    if o is None or hidden != o.N or not _float(b.sinks):
        return False
    keep.append(b.sinks)
    c.o = o
    c.hq, c.hkv, c.d, c.ogate = b.heads, b.kv_heads, b.head_dim, b.output_gate
    c.rope = -1 if b.rope is None else b.rope
    c.half, c.interleaved = b.rope_half, b.interleaved
    c.scale, c.softcap, c.sinks = b.scale, b.softcap or 0.0, _addr(b.sinks)
    return True


def _norm_ok(norm: tuple[torch.Tensor, float] | None, n: int) -> bool:
    return norm is not None and _float(norm[0]) and norm[0].shape == (n,)


def _post(c, b: Block, hidden: int, keep: list) -> bool:
    """Fill c's post-norm fields from b.post_norms (None: none); False where they do not fit."""
    if b.post_norms is None:
        return True
    (w1, e1), (w2, e2) = b.post_norms
    if not (_norm_ok((w1, e1), hidden) and _norm_ok((w2, e2), hidden)) or b.moe is not None:
        return False  # (the MoE adds its experts into h itself)
    keep.append((w1, w2))
    c.post1, c.post2, c.post_eps1, c.post_eps2 = w1.data_ptr(), w2.data_ptr(), e1, e2
    return True


def _mla(c, b: Block, hidden: int, keep: list) -> bool:
    """Fill c's MLA fields from b.mla; False where the C step cannot take it."""
    m = b.mla
    q_rank = 0 if m.q_a is None else m.q_norm[0].shape[0]
    q = _linear(m.q, None, keep)
    q_a = _linear(m.q_a, m.q_a_bias, keep) if q_rank else _Linear()
    kv_a = _linear(m.kv_a, m.kv_a_bias, keep)
    o = _parts(b.o)
    shapes = [
        (q, m.heads * (m.nope + m.rope), q_rank or hidden),
        (q_a, q_rank, hidden if q_rank else 0),
        (kv_a, m.rank + m.rope, hidden),
    ]
    for lin, n, k in shapes:
        if lin is None or n != lin.N or any(k != lin.part[i].K for i in range(lin.parts)):
            return False
    half = m.latent.dtype == torch.float16
    caches = _cache_ok(m.latent, 3, half) and _cache_ok(m.k_pe, 3, half)
    if not caches or m.latent.shape[:2] != m.k_pe.shape[:2] or b.rope is None:
        return False
    if not (_float(m.kv_b) and m.kv_b.shape == (m.heads * (m.nope + m.v), m.rank)):
        return False
    if not _norm_ok(m.kv_norm, m.rank) or (q_rank and not _norm_ok(m.q_norm, q_rank)):
        return False
    if o is None or any(m.heads * m.v != p.K for p in o) or 2 * b.rope_half != m.rope:
        return False
    e = _Mla(heads=m.heads, rank=m.rank, dn=m.nope, dr=m.rope, dv=m.v, q_rank=q_rank, q=q)
    e.q_a, e.kv_a, e.kv_b = q_a, kv_a, m.kv_b.data_ptr()
    if q_rank:
        e.q_norm, e.q_eps = m.q_norm[0].data_ptr(), m.q_norm[1]
    e.kv_norm, e.kv_eps, e.scale = m.kv_norm[0].data_ptr(), m.kv_norm[1], m.scale
    e.latent, e.k_pe, e.half = m.latent.data_ptr(), m.k_pe.data_ptr(), half
    e.lsb, e.lss = m.latent.stride()[:2]
    e.psb, e.pss = m.k_pe.stride()[:2]
    e.rope_half, e.interleaved = b.rope_half, b.interleaved
    keep.append((m.kv_b, m.latent, m.k_pe, m.q_norm, m.kv_norm, e))
    c.mla = ctypes.addressof(e)
    return True


def _mlp(c, b: Block, hidden: int, keep: list) -> bool:
    """Fill c's MLP fields from b (a gated MLP or `moe`); False where the C step cannot."""
    if b.act not in ACTS:
        return False
    c.act, c.inter = ACTS[b.act], b.intermediate
    if b.moe is not None:
        return _moe(c, b, hidden, keep)
    gate_up = _linear(b.gate_up, b.gate_up_bias, keep)
    down = _linear(b.down, b.down_bias, keep)
    want = (2 * b.intermediate, hidden)
    if gate_up is None or down is None or want != (gate_up.N, down.N):
        return False
    c.gate_up, c.down = gate_up, down
    return True


def _delta_rows(d: Delta) -> tuple[int, int, int]:
    """in_proj's rows, the conv's channels (q|k|v) and o's values of a delta layer."""
    kd, vd = d.k_heads * d.k_dim, d.v_heads * d.v_dim
    return 2 * kd + 2 * vd + 2 * d.v_heads, 2 * kd + vd, vd


def _delta_scratch(blocks: list[Block]) -> torch.Tensor:
    """cpu_step.h's zdelta_t.scratch: MAX_ROWS rows of in_proj's output, the conv's and o."""
    n = max((sum(_delta_rows(b.delta)) for b in blocks if b.delta is not None), default=0)
    return torch.zeros(MAX_ROWS * n)


def _delta(c, d: Delta, hidden: int, scratch: torch.Tensor, keep: list) -> bool:
    """Fill c's delta from d; False where the C step cannot take it."""
    n_in, conv_dim, vd = _delta_rows(d)
    k = d.conv.shape[-1]
    lin = [_linear(d.in_proj, None, keep), _linear(d.out_proj, None, keep)]
    want = (n_in, hidden)
    if any(x is None for x in lin) or want != (lin[0].N, lin[1].N):
        return False
    ks = [p.K for x in lin for p in x.part[: x.parts]]
    if ks != [hidden] * lin[0].parts + [vd] * lin[1].parts:
        return False
    half = d.conv_state.dtype == torch.float16
    shapes = [
        (d.conv, (conv_dim, k)), (d.neg_a, (d.v_heads,)), (d.dt_bias, (d.v_heads,)),
        (d.norm, (d.v_dim,)), (d.state[0], (d.v_heads, d.k_dim, d.v_dim)),
    ]  # fmt: skip
    if not all(_float(t) and t.shape == shape for t, shape in shapes):
        return False
    conv_ok = d.conv_state.is_contiguous() and d.conv_state.device.type == "cpu"
    conv_ok = conv_ok and d.conv_state.shape[1:] == (conv_dim, k - 1)
    if not conv_ok or d.conv_state.dtype not in (torch.float16, torch.float32):
        return False
    if max(d.k_dim, d.v_dim) > DELTA_MAX_DIM or d.v_heads % d.k_heads or not _float(d.state):
        return False
    z = _Delta(in_proj=lin[0], out_proj=lin[1], hk=d.k_heads, hv=d.v_heads, dk=d.k_dim,
               dv=d.v_dim, kernel=k, grouped=d.grouped, eps=d.eps, conv_half=half)  # fmt: skip
    z.conv_w, z.neg_a, z.dt_bias, z.norm = (
        t.data_ptr() for t in (d.conv, d.neg_a, d.dt_bias, d.norm)
    )
    z.conv, z.state, z.scratch = d.conv_state.data_ptr(), d.state.data_ptr(), scratch.data_ptr()
    z.conv_sb, z.state_sb = d.conv_state.stride(0), d.state.stride(0)
    keep.append((d, z))
    c.delta = ctypes.addressof(z)
    return True


def _addr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Blocks:
    """The C view of a model's decoder blocks; `Blocks.build` returns None where some block
    or tensor does not fit the C step (the caller then runs its modules)."""

    def __init__(self, blocks: ctypes.Array, hidden: int, head: _Head | None, keep: list):
        self._blocks, self.hidden, self._head, self._keep = blocks, hidden, head, keep
        self.vocab = head.head.N if head is not None else None

    @classmethod
    def build(cls, blocks: list[Block], hidden: int, head: tuple | None = None) -> Blocks | None:
        """head: (final norm weight, eps, LM head weight) to compute the logits in the same
        call; where the head's weight does not fit, the call stops at the last block."""
        if library() is None or not blocks:
            return None
        keep: list = []
        c_head = None
        if head is not None and _float(head[0]):
            lin = _linear(head[2], None, keep)
            if lin is not None and head[0].shape == (hidden,):
                keep.append(head[0])
                c_head = _Head(norm=head[0].data_ptr(), eps=head[1], head=lin)
        arr = (_Block * len(blocks))()
        scratch = _delta_scratch(blocks)  # shared by the delta layers, which run one by one
        keep.append(scratch)
        for c, b in zip(arr, blocks, strict=True):
            if b.delta is not None:
                fits = _delta(c, b.delta, hidden, scratch, keep)
            else:
                fits = _attention(c, b, hidden, keep)
            norms = (b.norm1, b.norm2)
            fits = fits and _mlp(c, b, hidden, keep) and _post(c, b, hidden, keep)
            if not (fits and all(map(_float, norms))):
                return None
            keep.append(norms)
            c.norm1, c.norm2 = b.norm1.data_ptr(), b.norm2.data_ptr()
            c.eps1, c.eps2 = b.eps1, b.eps2
        return cls(arr, hidden, c_head, keep)

    def __call__(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        tables: list[tuple[torch.Tensor, ...]],
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Run every block on h (M, hidden) fp32 contiguous, in place, for M <= MAX_ROWS rows
        at positions (M,) int64 in the cache rows `rows` (M,) int64 (None: rows 0..M-1);
        tables: per rope, (cos, sin) of (1 or M, 1, half). Returns the logits (M, vocab) where
        the head was built in, else None."""
        m = h.shape[0]
        assert h.is_contiguous() and h.shape[1] == self.hidden and m <= MAX_ROWS
        assert positions.dtype == torch.int64 and positions.is_contiguous()
        if rows is not None:
            assert rows.dtype == torch.int64 and rows.is_contiguous() and rows.shape == (m,)
        n = len(tables)
        cos, sin, stride = (_ptr * n)(), (_ptr * n)(), (_i64 * n)()
        for j, (c, s) in enumerate(tables):
            cos[j], sin[j] = c.data_ptr(), s.data_ptr()
            stride[j] = c.shape[-1] if c.shape[0] > 1 else 0
        logits = torch.empty(m, self.vocab) if self._head is not None else None
        library().zoo_decode_blocks(
            self._blocks, len(self._blocks), h.data_ptr(), m, self.hidden,
            positions.data_ptr(), None if rows is None else rows.data_ptr(), cos, sin, stride,
            ctypes.byref(self._head) if self._head is not None else None,
            logits.data_ptr() if logits is not None else None, torch.get_num_threads(),
        )  # fmt: skip
        return logits
