"""A decode step's decoder blocks as one C call on CPUs (kernels/cpu/decode.c, and for the
blocks' MoE MLPs, gated DeltaNet layers, Mamba2 layers, short convs and MLA moe.c, delta.c,
mamba.c, shortconv.c, mla.c through the views of moe.py, delta.py, mamba.py, shortconv.py,
mla.py here).

For a few rows (one token per sequence) of a small model, an eager step spends more time
dispatching its ~20 ops per block and forking and joining threads for each product than in the
products themselves: SmolLM2-135M's 121 products took 5.0 ms of an 11.8 ms step. The C function
runs every block of the plain pre-norm kind (RMSNorm, GQA attention over the static cache with
rope, optional q/k norms and output gate, DeepSeek's MLA over its latent cache (mla.c), a gated
DeltaNet layer (delta.c), a Mamba2 layer (mamba.c) or a gated short conv (shortconv.c); a
gated SiLU / GELU MLP, a relu2 one or a MoE (moe.c: any routing of core.layers.moe.route,
SiLU-gated, gpt-oss's clamped or relu2 experts, biases, shared experts); Gemma's post-norms;
Nemotron-H's blocks of one sub-block; quantized or fp32 weights) inside one OpenMP region, with the
arithmetic of the separate ops. `Blocks` holds the C view of the blocks' tensors (built once:
the tensors must stay where they are, which it checks by identity) and runs it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu.build import MAX_ROWS, library
from kernels.cpu.delta import Delta, delta_scratch, delta_view
from kernels.cpu.mamba import Mamba, mamba_scratch, mamba_view
from kernels.cpu.mla import Latent, mla_view
from kernels.cpu.moe import Experts, moe_view
from kernels.cpu.shortconv import ShortConvLayer, sconv_scratch, sconv_view
from kernels.cpu.views import (
    ACTS,
    F32,
    I64,
    PTR,
    CLinear,
    address,
    cache_ok,
    is_fp32,
    linear_view,
    norm_ok,
)


class _Block(ctypes.Structure):
    _fields_ = [
        ("norm1", PTR), ("norm2", PTR), ("eps1", F32), ("eps2", F32),
        ("qkv", CLinear), ("o", CLinear), ("gate_up", CLinear), ("down", CLinear),
        ("k", PTR), ("v", PTR),
        *((name, I64) for name in ("ksb", "ksh", "kss", "vsb", "vsh", "vss", "slots", "ring",
                                    "hq", "hkv", "d", "rope", "half", "interleaved")),
        ("scale", F32), ("softcap", F32), ("sinks", PTR), ("act", I64), ("inter", I64),
        ("kv_half", I64), ("qnorm", PTR), ("knorm", PTR), ("qk_eps", F32), ("moe", PTR),
        ("delta", PTR), ("ogate", I64),
        ("post1", PTR), ("post2", PTR), ("post_eps1", F32), ("post_eps2", F32), ("mla", PTR),
        ("qk_whole", I64), ("mamba", PTR), ("rscale", F32), ("sconv", PTR), ("skip_attn", I64),
        ("skip_mlp", I64),
    ]  # fmt: skip


class _Head(ctypes.Structure):
    _fields_ = [("norm", PTR), ("eps", F32), ("head", CLinear)]


@dataclass
class Block:
    """One decoder block's tensors and shape, as the C step reads them. Weights: fp32 (N, K)
    tensors or `BlockWeight` / `QuantStack`; caches (B, Hkv, S, D) fp32 or fp16 (a ring of S
    slots when `ring`); `rope`: index of the step's cos/sin table, None for a layer without
    rope. An MLA block (`mla`) has no qkv nor k / v caches (None), and heads = kv_heads,
    head_dim = its v_head_dim. A block of one sub-block (Nemotron-H) skips the other:
    `skip_attention` (its fields NO_ATTENTION's, norm1 None; the MLP normed by norm2) or
    `skip_mlp` (norm2 None). act "relu2": a non-gated MLP, gate_up its up (I, H) alone."""

    norm1: torch.Tensor | None
    eps1: float
    norm2: torch.Tensor | None
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
    qk_whole: bool = False  # qk_norm's weights span all heads at once (MiniMax M2), not one head
    mamba: Mamba | None = None  # in place of attention (its fields then NO_ATTENTION's)
    residual_scale: float = 1.0  # each sub-block's output times this before its add (Granite)
    sconv: ShortConvLayer | None = None  # in place of attention, as `delta`
    skip_attention: bool = False
    skip_mlp: bool = False


# a Block's attention fields where its layer is not attention (`delta`, `mamba`, `sconv`)
NO_ATTENTION = dict(
    qkv=None, qkv_bias=None, o=None, o_bias=None, k_cache=None, v_cache=None, ring=False,
    heads=0, kv_heads=0, head_dim=0, rope=None, rope_half=0, interleaved=False, scale=0.0,
    softcap=None, sinks=None,
)  # fmt: skip
# a Block's MLP fields where its MLP is a MoE (`moe`) or absent (`skip_mlp`)
NO_MLP = dict(gate_up=None, gate_up_bias=None, down=None, down_bias=None, act="silu",
              intermediate=0)  # fmt: skip


def _gqa(c, b: Block, keep: list) -> bool:
    """Fill c's GQA attention fields (q|k|v, the caches, q/k norms); False where the C step
    cannot take them."""
    qkv, d = linear_view(b.qkv, b.qkv_bias, keep), b.head_dim
    half = b.k_cache.dtype == torch.float16
    if qkv is None or ((2 if b.output_gate else 1) * b.heads + 2 * b.kv_heads) * d != qkv.N:
        return False
    if not (cache_ok(b.k_cache, 4, half) and cache_ok(b.v_cache, 4, half)):
        return False
    if b.qk_norm is not None:
        qn, kn, eps = b.qk_norm
        q_size, k_size = (b.heads * d, b.kv_heads * d) if b.qk_whole else (d, d)
        if not (is_fp32(qn) and is_fp32(kn) and qn.shape == (q_size,) and kn.shape == (k_size,)):
            return False
        if b.qk_whole and b.output_gate:
            return False  # (q's rows then interleave the gate's)
        keep.append((qn, kn))
        c.qnorm, c.knorm, c.qk_eps, c.qk_whole = qn.data_ptr(), kn.data_ptr(), eps, b.qk_whole
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
    if b.mla is None:
        if not _gqa(c, b, keep):
            return False
    else:
        mla = mla_view(b.mla, (b.rope_half, b.interleaved), hidden, keep)
        if mla is None or b.rope is None:
            return False
        c.mla = ctypes.addressof(mla)
    o = linear_view(b.o, b.o_bias, keep)
    if o is None or hidden != o.N or not is_fp32(b.sinks):
        return False
    if any(b.heads * b.head_dim != o.part[i].K for i in range(o.parts)):
        return False
    keep.append(b.sinks)
    c.o = o
    c.hq, c.hkv, c.d, c.ogate = b.heads, b.kv_heads, b.head_dim, b.output_gate
    c.rope = -1 if b.rope is None else b.rope
    c.half, c.interleaved = b.rope_half, b.interleaved
    c.scale, c.softcap, c.sinks = b.scale, b.softcap or 0.0, address(b.sinks)
    return True


def _post(c, b: Block, hidden: int, keep: list) -> bool:
    """Fill c's post-norm fields from b.post_norms (None: none); False where they do not fit."""
    if b.post_norms is None:
        return True
    if b.residual_scale != 1.0:
        return False  # (the modules scale before the post-norm, the C step after it)
    (w1, e1), (w2, e2) = b.post_norms
    if not (norm_ok((w1, e1), hidden) and norm_ok((w2, e2), hidden)):
        return False
    if b.moe is not None or b.delta is not None or b.mamba is not None or b.sconv is not None:
        return False  # (the MoE and the recurrent layers add their output into h themselves)
    if b.skip_attention or b.skip_mlp:
        return False  # (a skipped sub-block's post-norm would not run)
    keep.append((w1, w2))
    c.post1, c.post2, c.post_eps1, c.post_eps2 = w1.data_ptr(), w2.data_ptr(), e1, e2
    return True


def _mlp(c, b: Block, hidden: int, keep: list) -> bool:
    """Fill c's MLP fields from b (a gated MLP or `moe`); False where the C step cannot."""
    if b.act not in ACTS:
        return False
    c.act, c.inter = ACTS[b.act], b.intermediate
    if b.moe is not None:
        moe = moe_view(b.moe, hidden, keep)
        c.moe = ctypes.addressof(moe) if moe is not None else None
        return moe is not None
    gate_up = linear_view(b.gate_up, b.gate_up_bias, keep)
    down = linear_view(b.down, b.down_bias, keep)
    want = ((1 if b.act == "relu2" else 2) * b.intermediate, hidden)
    if gate_up is None or down is None or want != (gate_up.N, down.N):
        return False
    c.gate_up, c.down = gate_up, down
    return True


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
        if head is not None and is_fp32(head[0]):
            lin = linear_view(head[2], None, keep)
            if lin is not None and head[0].shape == (hidden,):
                keep.append(head[0])
                c_head = _Head(norm=head[0].data_ptr(), eps=head[1], head=lin)
        arr = (_Block * len(blocks))()
        # shared by the delta (the Mamba2) layers, which run one by one
        scratch = delta_scratch([b.delta for b in blocks if b.delta is not None])
        m_scratch = mamba_scratch([b.mamba for b in blocks if b.mamba is not None])
        convs = sconv_scratch([b.sconv for b in blocks if b.sconv is not None], hidden)
        keep.append((scratch, m_scratch, convs))
        for c, b in zip(arr, blocks, strict=True):
            if b.skip_attention:
                fits = True
            elif b.delta is not None:
                delta = delta_view(b.delta, hidden, scratch, keep)
                c.delta = None if delta is None else ctypes.addressof(delta)
                fits = delta is not None
            elif b.mamba is not None:
                mamba = mamba_view(b.mamba, hidden, m_scratch, keep)
                c.mamba = None if mamba is None else ctypes.addressof(mamba)
                fits = mamba is not None
            elif b.sconv is not None:
                sconv = sconv_view(b.sconv, hidden, convs, keep)
                c.sconv = None if sconv is None else ctypes.addressof(sconv)
                fits = sconv is not None
            else:
                fits = _attention(c, b, hidden, keep)
            norms = (b.norm1, b.norm2)
            fits = fits and (b.skip_mlp or _mlp(c, b, hidden, keep)) and _post(c, b, hidden, keep)
            # a norm for each sub-block that runs, none for one skipped (is_fp32 passes None)
            normed = (b.norm1 is None, b.norm2 is None) == (b.skip_attention, b.skip_mlp)
            if not (fits and normed and all(map(is_fp32, norms))):
                return None
            keep.append(norms)
            c.norm1, c.norm2 = address(b.norm1), address(b.norm2)
            c.eps1, c.eps2, c.rscale = b.eps1, b.eps2, b.residual_scale
            c.skip_attn, c.skip_mlp = b.skip_attention, b.skip_mlp
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
        cos, sin, stride = (PTR * n)(), (PTR * n)(), (I64 * n)()
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
