"""A decode step's decoder blocks as one C call on CPUs (kernels/cpu_decode.c, cpu_moe.c).

For a few rows (one token per sequence) of a small model, an eager step spends more time
dispatching its ~20 ops per block and forking and joining threads for each product than in
the products themselves: SmolLM2-135M's 121 products took 5.0 ms of an 11.8 ms step. The C
function runs every block of the plain pre-norm kind (RMSNorm, GQA attention over the static
cache with rope and optional q/k norms, a gated SiLU / GELU MLP or a MoE: any routing of
core.layers.moe.route, SiLU-gated or gpt-oss's clamped experts, biases, shared experts;
quantized or fp32 weights) inside one OpenMP region, with the arithmetic of the separate ops.
`Blocks` holds the C view of the blocks' tensors (built once: the tensors must stay where they
are, which it checks by identity) and runs it.
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


class _Head(ctypes.Structure):
    _fields_ = [("norm", _ptr), ("eps", _f32), ("head", _Linear)]


@dataclass
class Block:
    """One decoder block's tensors and shape, as the C step reads them. Weights: fp32 (N, K)
    tensors or `BlockWeight` / `QuantStack`; caches (B, Hkv, S, D) fp32 or fp16 (a ring of S
    slots when `ring`); `rope`: index of the step's cos/sin table, None for a layer without
    rope."""

    norm1: torch.Tensor
    eps1: float
    norm2: torch.Tensor
    eps2: float
    qkv: object
    qkv_bias: torch.Tensor | None
    o: object
    o_bias: torch.Tensor | None
    gate_up: object
    gate_up_bias: torch.Tensor | None
    down: object
    down_bias: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
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
            linears = [_linear(b.qkv, b.qkv_bias, keep), _linear(b.o, b.o_bias, keep)]
            if b.moe is None:
                linears += [
                    _linear(b.gate_up, b.gate_up_bias, keep),
                    _linear(b.down, b.down_bias, keep),
                ]
            elif not _moe(c, b, hidden, keep):
                return None
            d = b.head_dim
            rows = [None if lin is None else lin.N for lin in linears]
            want = [(b.heads + 2 * b.kv_heads) * d, hidden, 2 * b.intermediate, hidden]
            want = want[: len(linears)]
            tensors = (b.norm1, b.norm2, b.sinks)
            caches = (b.k_cache, b.v_cache)
            half = b.k_cache.dtype == torch.float16
            caches_ok = all(
                t.dim() == 4 and t.stride(-1) == 1 and t.device.type == "cpu"
                and t.dtype == (torch.float16 if half else torch.float32) for t in caches
            )  # fmt: skip
            if rows != want or not all(map(_float, tensors)) or not caches_ok or b.act not in ACTS:
                return None
            if b.qk_norm is not None:
                qn, kn, eps = b.qk_norm
                if not (_float(qn) and _float(kn) and qn.shape == kn.shape == (d,)):
                    return None
                keep.append((qn, kn))
                c.qnorm, c.knorm, c.qk_eps = qn.data_ptr(), kn.data_ptr(), eps
            keep.append((*tensors, *caches))
            c.norm1, c.norm2, c.eps1, c.eps2 = (
                b.norm1.data_ptr(),
                b.norm2.data_ptr(),
                b.eps1,
                b.eps2,
            )
            c.qkv, c.o = linears[:2]
            if b.moe is None:
                c.gate_up, c.down = linears[2:]
            c.k, c.v = b.k_cache.data_ptr(), b.v_cache.data_ptr()
            c.ksb, c.ksh, c.kss = b.k_cache.stride()[:3]
            c.vsb, c.vsh, c.vss = b.v_cache.stride()[:3]
            c.slots, c.ring = b.k_cache.shape[2], b.ring
            c.hq, c.hkv, c.d = b.heads, b.kv_heads, d
            c.rope = -1 if b.rope is None else b.rope
            c.half, c.interleaved = b.rope_half, b.interleaved
            c.scale, c.softcap, c.sinks = b.scale, b.softcap or 0.0, _addr(b.sinks)
            c.act, c.inter, c.kv_half = ACTS[b.act], b.intermediate, half
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
