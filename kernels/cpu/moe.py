"""The C view of a MoE MLP for the fused CPU step (kernels/cpu/moe.c, step.h's zmoe_t): its
routing as core.layers.moe.route computes it, its stacked experts (fp32 or `BlockExperts`), their
biases and gpt-oss's clamped SwiGLU, and shared experts."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu.build import QWeightView, library
from kernels.cpu.views import (
    ACTS,
    F32,
    I64,
    PTR,
    CLinear,
    address,
    is_fp32,
    linear_view,
    weight_parts,
)


class CMoe(ctypes.Structure):  # step.h's zmoe_t
    _fields_ = [
        ("experts", I64), ("topk", I64), ("renorm", I64), ("inter", I64),
        ("router", CLinear), ("gate_up", PTR), ("down", PTR), ("scoring", I64),
        ("method", I64), ("groups", I64), ("topk_groups", I64), ("scale", F32),
        ("correction", PTR), ("gate_up_bias", PTR), ("down_bias", PTR), ("glu", I64),
        ("alpha", F32), ("limit", F32), ("shared_inter", I64), ("shared_act", I64),
        ("shared_gate_up", CLinear), ("shared_down", CLinear), ("shared_gate", CLinear),
        ("act", I64),
    ]  # fmt: skip


SCORINGS = {"softmax": 0, "sigmoid": 1}


TOPK_METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


MAX_EXPERTS = 1024  # as step.h


@dataclass
class Experts:
    """A MoE MLP the C step takes, as core.layers.moe.MoE computes it: `scoring` ("softmax" |
    "sigmoid") of `router` (E, H) fp32 logits (+ `router_bias`), the top `top_k` experts by
    `method` ("greedy" | "group_limited_greedy" | "noaux_tc": within the best `topk_groups` of
    `groups`, by score + `correction`), their weights renormalised where `renorm`, times
    `scale`; each expert a SiLU-gated MLP of `intermediate` rows, its gate|up (E, 2I, H) and
    down (E, H, I) fp32 tensors or `BlockExperts` of one format, with optional biases (E, 2I),
    (E, H); `clamp` (alpha, limit): gpt-oss's clamped SwiGLU over interleaved (gate, up) rows;
    `act` "relu2" (Nemotron-H): non-gated experts, gate_up their up (E, I, H) alone.
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
    act: str = "silu"


@dataclass
class SharedExperts:
    """A MoE's always-on MLP of `intermediate` rows (gate_up [gate | up] (2S, H), down
    (H, S), optional biases, act "silu" | "gelu_tanh"; act "relu2": not gated, gate_up its up
    (S, H) alone), its output times sigmoid(x . gate) where `gate` (1, H) is given (Qwen3-Next)."""

    gate_up: object
    gate_up_bias: torch.Tensor | None
    down: object
    down_bias: torch.Tensor | None
    intermediate: int
    act: str = "silu"
    gate: object = None


def _experts(w, rows: int, cols: int) -> ctypes.Array | None:
    """The C views of stacked experts' weights (E of them, each (rows, cols)), or None."""
    if isinstance(w, torch.Tensor):
        if w.dim() != 3 or w.shape[1:] != (rows, cols) or not is_fp32(w):
            return None
        step = rows * cols * 4
        views = [QWeightView(w.data_ptr() + e * step, rows, cols, 0) for e in range(w.shape[0])]
    else:
        parts = [weight_parts(x) for x in getattr(w, "experts", [None])]  # a BlockExperts' weights
        if any(p is None or len(p) != 1 for p in parts):
            return None
        views = [p[0] for p in parts]
        if {(v.N, v.K, v.type) for v in views} != {(rows, cols, views[0].type)}:
            return None
    return (QWeightView * len(views))(*views)


def _routing(m: Experts, keep: list) -> CMoe | None:
    """The routing fields of m's zmoe_t (None where the C step cannot take them)."""
    e = m.router.shape[0]
    vectors = (m.router_bias, m.correction)
    router = linear_view(m.router, m.router_bias, keep) if is_fp32(m.router) else None
    groups_ok = m.method == "greedy" or (e % m.groups == 0 and 0 < m.topk_groups <= m.groups)
    if (router is None or not all(v is None or (is_fp32(v) and v.shape == (e,)) for v in vectors)
            or m.scoring not in SCORINGS or m.method not in TOPK_METHODS or not groups_ok
            or not 0 < m.top_k <= min(e, 64) or e > MAX_EXPERTS):  # fmt: skip
        return None
    keep.append(vectors)
    return CMoe(
        experts=e, topk=m.top_k, renorm=m.renorm, router=router, scoring=SCORINGS[m.scoring],
        method=TOPK_METHODS[m.method], groups=m.groups, topk_groups=m.topk_groups,
        scale=m.scale, correction=address(m.correction),
    )  # fmt: skip


def _shared(c: CMoe, s: SharedExperts, hidden: int, keep: list) -> bool:
    """Fill c's shared experts' fields from s; False where the C step cannot take them."""
    gate_up = linear_view(s.gate_up, s.gate_up_bias, keep)
    down = linear_view(s.down, s.down_bias, keep)
    gate = None if s.gate is None else linear_view(s.gate, None, keep)
    rows = _rows(s.act) * s.intermediate
    want = [(gate_up, rows), (down, hidden), *[(gate, 1)] * (s.gate is not None)]
    if any(lin is None or n != lin.N for lin, n in want) or s.act not in ACTS:
        return False
    c.shared_inter, c.shared_act = s.intermediate, ACTS[s.act]
    c.shared_gate_up, c.shared_down = gate_up, down
    if gate is not None:
        c.shared_gate = gate
    return True


def _rows(act: str) -> int:
    """gate_up's rows per intermediate row: 2 ([gate | up]), 1 for relu2's up alone."""
    return 1 if act == "relu2" else 2


def moe_view(m: Experts, hidden: int, keep: list) -> CMoe | None:
    """step.h's zmoe_t of m, kept alive in `keep`; None where the C step cannot take it."""
    i = m.intermediate
    e = _routing(m, keep)
    if m.act not in ("silu", "relu2") or (m.act == "relu2" and m.clamp is not None):
        return None
    gate_up, down = _experts(m.gate_up, _rows(m.act) * i, hidden), _experts(m.down, hidden, i)
    biases = ((m.gate_up_bias, _rows(m.act) * i), (m.down_bias, hidden))
    if e is None or gate_up is None or down is None:
        return None
    if not len(gate_up) == len(down) == e.experts:
        return None
    if not all(x is None or (is_fp32(x) and x.shape == (e.experts, n)) for x, n in biases):
        return None
    if m.shared is not None and not _shared(e, m.shared, hidden, keep):
        return None
    e.inter, e.gate_up, e.down = i, ctypes.addressof(gate_up), ctypes.addressof(down)
    e.gate_up_bias, e.down_bias = address(m.gate_up_bias), address(m.down_bias)
    e.glu, (e.alpha, e.limit) = m.clamp is not None, m.clamp or (0.0, 0.0)
    e.act = ACTS[m.act]
    keep.append((m.gate_up, m.down, gate_up, down, m.gate_up_bias, m.down_bias, e))
    return e


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
