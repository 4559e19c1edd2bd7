"""A decode step's decoder blocks as one C call on CPUs (kernels/cpu_decode.c, cpu_moe.c).

For a few rows (one token per sequence) of a small model, an eager step spends more time
dispatching its ~20 ops per block and forking and joining threads for each product than in
the products themselves: SmolLM2-135M's 121 products took 5.0 ms of an 11.8 ms step. The C
function runs every block of the plain pre-norm kind (RMSNorm, GQA attention over the static
cache with rope and optional q/k norms, or DeepSeek's MLA over its latent cache
(kernels/cpu_mla.c); a gated SiLU / GELU MLP or a MoE of them with softmax top-k routing;
Gemma's post-norms; quantized or fp32 weights) inside one OpenMP region,
with the arithmetic of the separate ops. `Blocks` holds the C view of the blocks' tensors
(built once: the tensors must stay where they are, which it checks by identity) and runs it.
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
        ("post1", _ptr), ("post2", _ptr), ("post_eps1", _f32), ("post_eps2", _f32), ("mla", _ptr),
    ]  # fmt: skip


class _Moe(ctypes.Structure):  # cpu_step.h's zmoe_t
    _fields_ = [
        ("experts", _i64), ("topk", _i64), ("renorm", _i64), ("inter", _i64),
        ("router", _Linear), ("gate_up", _ptr), ("down", _ptr),
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
    # (attention's, the MLP's) output RMSNorm (weight, eps) before each residual add, or None
    post_norms: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None = None
    mla: Latent | None = None  # in place of qkv and the k / v caches


@dataclass
class Experts:
    """A MoE MLP the C step takes: softmax over `router` (E, H) fp32 logits, the top `top_k`
    experts (renormalised where `renorm`), each a SiLU-gated MLP of `intermediate` rows: its
    gate|up (E, 2I, H) and down (E, H, I), fp32 tensors or `BlockExperts` of one format."""

    router: torch.Tensor
    top_k: int
    renorm: bool
    intermediate: int
    gate_up: object
    down: object


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


def _moe(c, b: Block, hidden: int, keep: list) -> bool:
    """Fill c's MoE fields from b.moe; False where the C step cannot take it."""
    m = b.moe
    router = _linear(m.router, None, keep) if _float(m.router) else None
    i = m.intermediate
    gate_up, down = _experts(m.gate_up, 2 * i, hidden), _experts(m.down, hidden, i)
    if router is None or gate_up is None or down is None or not 0 < m.top_k <= 64:
        return False
    e = _Moe(experts=m.router.shape[0], topk=m.top_k, renorm=m.renorm, inter=i, router=router)
    e.gate_up, e.down = ctypes.addressof(gate_up), ctypes.addressof(down)
    keep.append((m.gate_up, m.down, gate_up, down, e))
    c.moe = ctypes.addressof(e)
    return True


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
    if qkv is None or (b.heads + 2 * b.kv_heads) * d != qkv.N:
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
        for c, b in zip(arr, blocks, strict=True):
            attention = _gqa(c, b, keep) if b.mla is None else _mla(c, b, hidden, keep)
            linears = [_linear(b.o, b.o_bias, keep)]
            if b.moe is None:
                linears += [
                    _linear(b.gate_up, b.gate_up_bias, keep),
                    _linear(b.down, b.down_bias, keep),
                ]
            elif not _moe(c, b, hidden, keep):
                return None
            rows = [None if lin is None else lin.N for lin in linears]
            want = [hidden, 2 * b.intermediate, hidden][: len(linears)]
            tensors = (b.norm1, b.norm2, b.sinks)
            if not attention or rows != want or not all(map(_float, tensors)):
                return None
            if b.act not in ACTS or not _post(c, b, hidden, keep):
                return None
            keep.append(tensors)
            c.norm1, c.norm2, c.eps1, c.eps2 = (
                b.norm1.data_ptr(),
                b.norm2.data_ptr(),
                b.eps1,
                b.eps2,
            )
            c.o = linears[0]
            if b.moe is None:
                c.gate_up, c.down = linears[1:]
            c.hq, c.hkv, c.d = b.heads, b.kv_heads, b.head_dim
            c.rope = -1 if b.rope is None else b.rope
            c.half, c.interleaved = b.rope_half, b.interleaved
            c.scale, c.softcap, c.sinks = b.scale, b.softcap or 0.0, _addr(b.sinks)
            c.act, c.inter = ACTS[b.act], b.intermediate
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
