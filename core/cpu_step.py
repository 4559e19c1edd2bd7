"""The eager decode step on CPUs: every decoder block in one C call (kernels/cpu/decode.py).

Where each block of a fp32 CPU model is of the core's kinds (RMSNorm before each sub-block,
and after it with Gemma's post-norms; GQA attention with or without RMSNorm q/k norms (per
head, or over all heads at once: MiniMax M2) and a sigmoid output gate, DeepSeek's MLA, a
gated DeltaNet, a Mamba2 layer or a gated short conv (LFM2); a gated SiLU / GELU MLP, a
non-gated relu2 one or a MoE: any routing of `core.layers.moe.route`, SiLU-gated, gpt-oss's
clamped or relu2 experts with or without biases, shared experts gated or not; Nemotron-H's
blocks of one sub-block, attention's or the MLP's; weights fp32 or kept quantized), the step
embeds the tokens, hands the blocks to `kernels.cpu.decode.Blocks` and runs the final norm and
the head; otherwise, or for more than `MAX_ROWS` rows, under `ZOO_KERNELS=torch|triton`, or
where the C library cannot be built, the modules run as always. The two agree to fp32
rounding (tests/core/test_cpu_step.py). Which models take it: `zoo info` says. Several
consecutive tokens of one row (a chain: drafted tokens verified) go in one call where no layer
is recurrent or a ring that wraps (`FusedStep.takes_chain`; tests/core/test_cpu_step_chain.py).
"""

from __future__ import annotations

import os

import torch

from core.config_kinds import SparseMLASpec
from core.cpu_recurrent import RECURRENT, recurrent_view
from core.layers import GatedMLP, GQAAttention, Linear, LMHead, RMSNorm
from core.layers.deltanet import GatedDeltaNet
from core.layers.mamba2 import Mamba2
from core.layers.mla import MLAAttention
from core.layers.moe import MoE
from core.modeling import CausalLM, DecoderBlock
from kernels.blocks import BlockWeight
from kernels.cpu.build import MAX_ROWS, library
from kernels.cpu.decode import NO_ATTENTION, NO_MLP, Block, Blocks
from kernels.cpu.delta import DELTA_MAX_DIM
from kernels.cpu.mla import Latent
from kernels.cpu.moe import MAX_EXPERTS, Experts, SharedExperts
from kernels.cpu.views import ACTS
from kernels.qweight import QuantStack, QuantWeight

# the attention kinds the step takes (the recurrent ones: RECURRENT, core/cpu_recurrent.py's
# views, which add into h themselves)
ATTENTION = (GQAAttention, MLAAttention, *RECURRENT)


def why_not(net: CausalLM) -> str | None:
    """Why the fused step cannot run `net` (None: it can): the first block or tensor that
    does not fit, for `zoo info` and the logs."""
    w = net.model.embed_tokens.weight
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return f"weights are {w.dtype} on {w.device.type}, not float32 on the CPU"
    for i, layer in enumerate(net.model.layers):
        if type(layer) is not DecoderBlock:
            return f"block {i} is {type(layer).__name__}"
        if layer.reduce is not None:
            return f"block {i} sums its outputs over tensor-parallel ranks"
        if layer.per_layer_input is not None or layer.layer_scalar is not None:
            return f"block {i} has per-layer inputs or a layer scalar (Gemma 4)"
        if layer.residual_scale != 1.0 and layer.post_norms:  # (the C step scales after them)
            return f"block {i} scales its sub-blocks' outputs by residual_scale before post-norms"
        attn, mlp = layer.self_attn, layer.mlp  # None: a NoSubBlock (Nemotron-H)
        if not layer.pre_norms:
            return f"block {i} norms only its sub-blocks' outputs (the fused step: pre-norms)"
        spec = getattr(attn, "spec", None)
        if isinstance(spec, SparseMLASpec):
            k = spec.index_topk
            return f"block {i} is DeepSeek sparse attention (top-{k} keys), not the fused step's"
        mlp_kind = MoE if type(mlp) is MoE else GatedMLP
        attn_kind = None if attn is None else next((k for k in ATTENTION if type(attn) is k),
                                                   GQAAttention)  # fmt: skip
        kinds = [(p, kind) for p, kind in ((attn, attn_kind), (mlp, mlp_kind)) if p is not None]
        kinds += [(n, RMSNorm) for n in _pre_norms(layer) if n is not None]
        if layer.post_norms:
            if type(mlp) is MoE:
                return f"block {i} has post-norms around a MoE MLP"
            kinds += [(n, RMSNorm) for n in _post_norms(layer)]
        for part, kind in kinds:
            if type(part) is not kind:  # a subclass may compute more
                return f"block {i} has a {type(part).__name__} where it takes a {kind.__name__}"
        if attn_kind is MLAAttention:
            for name in ("q_a_layernorm", "kv_a_layernorm"):  # (no q_a: a plain q_proj)
                norm = getattr(attn, name, None)
                if norm is not None and type(norm) is not RMSNorm:
                    return f"block {i}'s MLA {name} is a {type(norm).__name__}"
            if net.rope_of_layer[i] is None:
                return f"block {i} is MLA without rope"
        elif attn_kind is GQAAttention and (why := _gqa_why_not(attn.spec)):
            return f"block {i} {why}"
        elif attn_kind is GQAAttention and attn.spec.qk_norm:
            for norm in (attn.q_norm, attn.k_norm):
                if type(norm) is not RMSNorm:
                    return f"block {i} norms q and k with a {type(norm).__name__}"
        elif attn_kind is GatedDeltaNet:
            d = attn.spec
            if max(d.head_k_dim, d.head_v_dim) > DELTA_MAX_DIM or d.num_v_heads % d.num_k_heads:
                return (
                    f"block {i}'s DeltaNet heads ({d.num_k_heads} x {d.head_k_dim} keys, "
                    f"{d.num_v_heads} x {d.head_v_dim} values) are not the fused step's"
                )
        elif attn_kind is Mamba2 and attn.spec.gated_norm != "gate_first":
            return f"block {i}'s Mamba2 gates after its norm or has none (Falcon-H1)"
        if attn_kind in RECURRENT and layer.post_norms:
            return f"block {i} has post-norms around a {attn_kind.__name__} layer"
        why = _moe_why_not(mlp) if type(mlp) is MoE else None
        if why is None and type(mlp) is GatedMLP and mlp.act not in ACTS:
            why = f"activation is {mlp.act}"
        if why:
            return f"block {i}'s {why}"
    return None


def why_no_chain(net: CausalLM) -> str | None:
    """Why the fused step cannot take several consecutive tokens of one cache row (None: it
    can): a recurrent layer would step its row's state by each token at once, and a ring that
    wraps would evict, at a later token's slot, a key that an earlier token still reads."""
    seq = net.kv_cache.max_seq_len if net.kv_cache is not None else None
    for i, layer in enumerate(net.model.layers):
        attn = layer.self_attn
        if type(attn) in RECURRENT:
            return f"block {i} is a recurrent layer ({type(attn).__name__})"
        window = getattr(getattr(attn, "spec", None), "window", None)
        if window is not None and (seq is None or window < seq):
            return f"block {i} keeps a ring of its last {window} positions"
    return None


def kinds(net: CausalLM) -> str:
    """The blocks by kind, for `zoo info`: '3 x GatedDeltaNet + MoE, 1 x GQAAttention + MoE'."""
    counts: dict[str, int] = {}
    for layer in net.model.layers:
        post = " (post-norms)" if getattr(layer, "post_norms", False) else ""
        post = post if getattr(layer, "pre_norms", True) else " (post-norms only)"
        parts = (layer.self_attn, layer.mlp)  # None: a NoSubBlock (Nemotron-H)
        kind = " + ".join(type(p).__name__ for p in parts if p is not None) + post
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{n} x {kind}" for kind, n in counts.items())


def _gqa_why_not(s) -> str | None:
    """Why the C step cannot run this GQA spec (None: it can): Gemma 4's shared K/V, value
    norms and K = V, Llama 4's chunked attention, Ministral 3's and Llama 4's query scales."""
    if s.kv_source is not None:
        return f"reads the keys and values of layer {s.kv_source} (no cache of its own)"
    if s.v_norm is not None or s.k_eq_v:
        return "norms its values, or takes them from k_proj (Gemma 4)"
    if s.chunk is not None:
        return f"has chunked attention ({s.chunk}) (the fused step: full or sliding)"
    if s.query_scale is not None:
        return "scales queries by position (the fused step: no query scale)"
    return None


def _moe_why_not(mlp: MoE) -> str | None:
    """Why the C step cannot run this MoE MLP (None: it can): it takes every routing of
    `core.layers.moe.route`, routed experts of SiLU-gated or clamped SwiGLU with or without
    biases or non-gated relu2 (Nemotron-H), and shared experts (gated or not); not other
    activations nor very many experts."""
    s = mlp.gate.spec
    if s.act not in ("silu", "relu2"):
        return f"MoE's routed experts use {s.act} (the fused step: SiLU or relu2)"
    if s.scale_input:
        return "MoE weights its experts' inputs (the fused step: their outputs)"
    if s.num_experts > MAX_EXPERTS or s.top_k > 64:
        return f"MoE routes to {s.top_k} of {s.num_experts} experts (at most 64 of {MAX_EXPERTS})"
    grouped = s.topk_method != "greedy"
    if grouped and (s.num_experts % s.num_groups or not 0 < s.topk_groups <= s.num_groups):
        return f"MoE's {s.num_experts} experts do not split into {s.num_groups} groups"
    shared = getattr(mlp, "shared_experts", None)
    if shared is not None and (type(shared) is not GatedMLP or shared.act not in ACTS):
        return f"MoE's shared experts are a {type(shared).__name__} of {shared.act}"
    gate = getattr(mlp, "shared_expert_gate", None)
    if gate is not None and type(gate) is not Linear:
        return f"MoE's shared expert gate is a {type(gate).__name__}"
    return None


def _norm_weight(norm: RMSNorm) -> torch.Tensor:
    return norm.scale().contiguous()


def _norm(norm: RMSNorm | None) -> tuple[torch.Tensor | None, float]:
    return (None, 0.0) if norm is None else (_norm_weight(norm), norm.eps)  # (a Block's)


def _up(mlp: GatedMLP) -> Linear:
    """A dense MLP's first product: gate_up_proj, or up_proj alone where it is not gated."""
    return mlp.gate_up_proj if mlp.gated else mlp.up_proj


def _mlp(mlp) -> dict:
    """Block's MLP fields for a GatedMLP, a MoE (`moe`), or none (`skip_mlp`)."""
    if mlp is None:
        return dict(NO_MLP, skip_mlp=True)
    if type(mlp) is MoE:
        return dict(NO_MLP, moe=_experts(mlp))
    up = _up(mlp)
    return dict(gate_up=up.weight, gate_up_bias=up.bias, down=mlp.down_proj.weight,
                down_bias=mlp.down_proj.bias, act=mlp.act,
                intermediate=mlp.down_proj.in_features)  # fmt: skip


def _pre_norms(layer: DecoderBlock) -> tuple[RMSNorm | None, RMSNorm | None]:
    """The norms before attention and the MLP (Nemotron-H's one-mixer layers: None, and the
    one sub-block there is normed by input_layernorm)."""
    if layer.self_attn is None:
        return None, layer.input_layernorm
    if layer.mlp is None:
        return layer.input_layernorm, None
    return layer.input_layernorm, layer.post_attention_layernorm


def _post_norms(layer: DecoderBlock) -> tuple[RMSNorm, RMSNorm]:
    """Gemma's norms of attention's and the MLP's output, before each residual add."""
    return layer.attn_out_layernorm, layer.post_feedforward_layernorm


def blocks(net: CausalLM) -> Blocks | None:
    """The C view of net's blocks (which `why_not` passed), or None where some tensor does
    not fit the C step."""
    if net.kv_cache is None:
        return None
    out = []
    for i, layer in enumerate(net.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        cache = net.kv_cache.layer(i)  # as the layer's kind lays it out
        if attn is None:
            kw = dict(NO_ATTENTION, skip_attention=True)
        elif type(attn) in RECURRENT:
            kw = dict(NO_ATTENTION, **recurrent_view(attn, *cache))
        elif type(attn) is MLAAttention:
            kw = _latent(net, i, attn, *cache)
        else:
            kw = _attention(net, i, attn, *cache)
        post = [_norm(n) for n in _post_norms(layer)] if layer.post_norms else None
        (w1, e1), (w2, e2) = (_norm(n) for n in _pre_norms(layer))
        out.append(Block(norm1=w1, eps1=e1, norm2=w2, eps2=e2, **_mlp(mlp), post_norms=post,
                         residual_scale=layer.residual_scale, **kw))  # fmt: skip
    tied = net.lm_head.tied_to[0]
    final = net.model.norm
    head = None
    # the final norm and the head join the call where they are the core's own (a subclass,
    # such as tensor parallelism's gathering head, runs as a module after the call)
    if type(final) is RMSNorm and type(net.lm_head) is LMHead:
        head = (*_norm(final), tied.weight if tied is not None else net.lm_head.weight)
    return Blocks.build(out, net.config.hidden_size, head)


def _rope(net: CausalLM, i: int, attn) -> dict:
    """Block's rope fields for layer i."""
    j = net.rope_of_layer[i]
    return dict(
        rope=j,
        rope_half=0 if j is None else net.rotaries[j].cos.shape[-1],
        interleaved=attn.interleaved,
    )


def _attention(net: CausalLM, i: int, attn: GQAAttention, k, v) -> dict:
    """Block's attention fields for layer i's GQA attention and its cache k, v."""
    s = attn.spec
    return dict(
        qkv=attn.qkv_proj.weight,
        qkv_bias=attn.qkv_proj.bias,
        o=attn.o_proj.weight,
        o_bias=attn.o_proj.bias,
        k_cache=k,
        v_cache=v,
        ring=s.window is not None,
        heads=s.num_heads,
        kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        **_rope(net, i, attn),
        scale=s.scale,
        softcap=s.softcap,
        sinks=attn.sinks if s.sinks else None,
        qk_norm=_qk_norm(attn),
        output_gate=s.output_gate,
        qk_whole=s.qk_norm_all_heads,
    )


def _latent(net: CausalLM, i: int, attn: MLAAttention, latent, k_pe) -> dict:
    """Block's attention fields for layer i's MLA: its heads in place of q|k|v, its latent
    and k_pe caches in place of k / v."""
    s = attn.spec
    q_a = getattr(attn, "q_a_proj", None)
    mla = Latent(
        heads=s.num_heads,
        rank=s.kv_lora_rank,
        nope=s.qk_nope_head_dim,
        rope=s.qk_rope_head_dim,
        v=s.v_head_dim,
        q=attn.q_proj.weight if q_a is None else attn.q_b_proj.weight,
        q_a=None if q_a is None else q_a.weight,
        q_a_bias=None if q_a is None else q_a.bias,
        q_norm=None if q_a is None else (_norm_weight(attn.q_a_layernorm), attn.q_a_layernorm.eps),
        kv_a=attn.kv_a_proj_with_mqa.weight,
        kv_a_bias=attn.kv_a_proj_with_mqa.bias,
        kv_norm=(_norm_weight(attn.kv_a_layernorm), attn.kv_a_layernorm.eps),
        kv_b=attn.kv_b_proj.weight,
        latent=latent,
        k_pe=k_pe,
        scale=s.scale,
    )
    return dict(qkv=None, qkv_bias=None, o=attn.o_proj.weight, o_bias=attn.o_proj.bias,
                k_cache=None, v_cache=None, ring=False, heads=s.num_heads, kv_heads=s.num_heads,
                head_dim=s.v_head_dim, scale=s.scale, softcap=None, sinks=None, mla=mla,
                **_rope(net, i, attn))  # fmt: skip


def _qk_norm(attn: GQAAttention) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    if attn.spec.qk_norm is None:
        return None
    return _norm_weight(attn.q_norm), _norm_weight(attn.k_norm), attn.q_norm.eps


def _experts(mlp: MoE) -> Experts:
    s, ex, router = mlp.gate.spec, mlp.experts, mlp.gate
    first = ex.gate_up_proj if ex.gated else ex.up_proj  # (relu2's experts: up alone)
    shared = getattr(mlp, "shared_experts", None)
    if shared is not None:
        gate = getattr(mlp, "shared_expert_gate", None)
        shared = SharedExperts(
            gate_up=_up(shared).weight,
            gate_up_bias=_up(shared).bias,
            down=shared.down_proj.weight,
            down_bias=shared.down_proj.bias,
            intermediate=shared.down_proj.in_features,
            act=shared.act,
            gate=None if gate is None else gate.weight,
        )
    return Experts(
        router=router.weight,
        top_k=s.top_k,
        renorm=s.norm_topk_prob,
        intermediate=s.intermediate_size,
        gate_up=first.weight,
        down=ex.down_proj.weight,
        router_bias=getattr(router, "bias", None),
        scoring=s.scoring,
        method=s.topk_method,
        groups=s.num_groups,
        topk_groups=s.topk_groups,
        scale=s.routed_scaling_factor,
        correction=getattr(router, "e_score_correction_bias", None),
        gate_up_bias=getattr(first, "bias", None),
        down_bias=getattr(ex.down_proj, "bias", None),
        clamp=None if s.glu is None else (s.glu.alpha, s.glu.limit),
        shared=shared,
        act="silu" if ex.gated else "relu2",
    )


def _first_weight(net: CausalLM) -> torch.Tensor:
    attn = next(layer.self_attn for layer in net.model.layers if layer.self_attn is not None)
    w = (attn.out_proj if type(attn) in RECURRENT else attn.o_proj).weight
    while isinstance(w, QuantStack):
        w = w.parts[0]
    if isinstance(w, BlockWeight):
        return w.blocks
    return w.codes if isinstance(w, QuantWeight) else w


class FusedStep:
    """`step(tokens (B,), positions (B,), end, rows=None) -> logits (B, vocab)` through the C
    blocks, or None from `__call__` where they cannot run this call (the caller runs the
    modules). rows: the cache rows the tokens belong to (B,); None: rows 0..B-1."""

    def __init__(self, net: CausalLM):
        self.net = net
        self.unfit = why_not(net)  # the kinds of blocks do not change; their tensors may
        self.unchained = why_no_chain(net)
        self._built: tuple | None = None  # (the tensors the view was built from, the view)

    def _blocks(self) -> Blocks | None:
        # rebuilt if the cache or the weights were replaced (the view holds their addresses)
        key = (self.net.kv_cache, _first_weight(self.net).data_ptr())
        if self._built is None or self._built[0] != key:
            self._built = (key, blocks(self.net))
        return self._built[1]

    def why_not(self, rows: int = 1) -> str | None:
        """Why a step of `rows` rows runs the modules now (None: it runs fused)."""
        mode = os.environ.get("ZOO_KERNELS") or "auto"
        if self.unfit is not None:
            return self.unfit
        if rows > MAX_ROWS:
            return f"{rows} rows, more than the C products take ({MAX_ROWS})"
        if mode != "auto":
            return f"ZOO_KERNELS={mode}"
        if library() is None:
            return "no C compiler for kernels/cpu/decode.c"
        if self._blocks() is None:
            return "a weight or cache tensor the C step cannot read"
        return None

    def takes_chain(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens may hold chains (`__call__`'s rows naming a cache
        row more than once: that sequence's tokens at consecutive positions, each attending to
        the row's cache up to its own, as the modules' forward of those tokens computes them).
        Not where a layer is recurrent or a ring that wraps (`unchained` says which)."""
        return self.unchained is None and self.why_not(tokens) is None

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        end: int,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        b = tokens.shape[0]
        if self.why_not(b) is not None:
            return None
        net, fused = self.net, self._built[1]  # why_not built (or checked) it just now
        pos = positions.to(torch.int64).contiguous()
        if b and not 0 <= int(pos.min()) <= int(pos.max()) < net.kv_cache.max_seq_len:
            raise IndexError(
                f"positions {pos.tolist()} past the cache's {net.kv_cache.max_seq_len}"
            )
        if rows is not None:  # the C step writes where these point: check them first
            rows = rows.to(torch.int64).contiguous()
            self._check_rows(rows.tolist(), pos.tolist())
        h = net.model.embed_tokens(tokens[:, None]).reshape(b, -1).contiguous()
        tables = [tuple(t.contiguous() for t in rotary(pos, 1, end)) for rotary in net.rotaries]
        logits = fused(h, pos, tables, rows)
        return net.head(h[:, None])[:, -1] if logits is None else net.scale_logits(logits)

    def _check_rows(self, at: list[int], pos: list[int]) -> None:
        """IndexError unless the cache rows `at` of the tokens at positions `pos` are rows of
        the cache, each named once or (where the step takes chains) at consecutive positions
        in the order the tokens come."""
        b, top = len(pos), self.net.kv_cache.max_batch_size
        if len(at) != b or not 0 <= min(at, default=0) <= max(at, default=0) < top:
            raise IndexError(f"cache rows {at} for {b} tokens ({top} rows)")
        if len(set(at)) == b:
            return
        if self.unchained is not None:  # (the rest of takes_chain: __call__ checked it)
            raise IndexError(
                f"cache rows {at} name a row twice, and this model's step takes no chains "
                f"({self.unchained}): name each row once"
            )
        last: dict[int, int] = {}
        for row, p in zip(at, pos, strict=True):
            if row in last and p != last[row] + 1:
                raise IndexError(
                    f"cache rows {at} at positions {pos}: row {row}'s tokens go at consecutive "
                    f"positions ({last[row] + 1} after {last[row]}, not {p})"
                )
            last[row] = p
