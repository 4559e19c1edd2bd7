"""The eager decode step on CPUs: every decoder block in one C call (kernels/cpu_decode.py).

Where each block of a fp32 CPU model is of the core's plain kind (RMSNorm before each
sub-block, and after it with Gemma's post-norms; GQA attention with or without RMSNorm q/k
norms, or DeepSeek's MLA; a gated SiLU / GELU MLP or a MoE of them routed by softmax top-k,
without shared experts; weights fp32 or kept quantized), the step
embeds the tokens, hands the blocks to `kernels.cpu_decode.Blocks` and runs the final norm and
the head; otherwise, or for more than `MAX_ROWS` rows, under `ZOO_KERNELS=torch|triton`, or
where the C library cannot be built, the modules run as always. The two agree to fp32
rounding (tests/core/test_cpu_step.py). Which models take it: `zoo info` says.
"""

from __future__ import annotations

import os

import torch

from core.layers import GatedMLP, GQAAttention, LMHead, RMSNorm
from core.layers.mla import MLAAttention
from core.layers.moe import MoE
from core.modeling import CausalLM, DecoderBlock
from kernels.blocks import BlockWeight
from kernels.cpu_decode import ACTS, Block, Blocks, Experts, Latent
from kernels.cpu_quant import MAX_ROWS, library
from kernels.qweight import QuantStack, QuantWeight


def why_not(net: CausalLM) -> str | None:
    """Why the fused step cannot run `net` (None: it can): the first block or tensor that
    does not fit, for `zoo info` and the logs."""
    w = net.model.embed_tokens.weight
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return f"weights are {w.dtype} on {w.device.type}, not float32 on the CPU"
    for i, layer in enumerate(net.model.layers):
        if type(layer) is not DecoderBlock:
            return f"block {i} is {type(layer).__name__}"
        attn, mlp = layer.self_attn, layer.mlp
        mlp_kind = MoE if type(mlp) is MoE else GatedMLP
        attn_kind = MLAAttention if type(attn) is MLAAttention else GQAAttention
        kinds = [(attn, attn_kind), (mlp, mlp_kind), (layer.input_layernorm, RMSNorm),
                 (layer.post_attention_layernorm, RMSNorm)]  # fmt: skip
        if layer.post_norms:
            if type(mlp) is MoE:
                return f"block {i} has post-norms around a MoE MLP"
            kinds += [(n, RMSNorm) for n in _post_norms(layer)]
        for part, kind in kinds:
            if type(part) is not kind:  # a subclass may compute more (tensor parallelism's sum)
                return f"block {i} has a {type(part).__name__} where it takes a {kind.__name__}"
        if attn_kind is MLAAttention:
            for name in ("q_a_layernorm", "kv_a_layernorm"):  # (no q_a: a plain q_proj)
                norm = getattr(attn, name, None)
                if norm is not None and type(norm) is not RMSNorm:
                    return f"block {i}'s MLA {name} is a {type(norm).__name__}"
            if net.rope_of_layer[i] is None:
                return f"block {i} is MLA without rope"
        elif attn.spec.qk_norm is not None and type(attn.q_norm) is not RMSNorm:
            return f"block {i} norms q and k with a {type(attn.q_norm).__name__}"
        why = _moe_why_not(mlp) if type(mlp) is MoE else None
        if why is None and type(mlp) is GatedMLP and mlp.act not in ACTS:
            why = f"activation is {mlp.act}"
        if why:
            return f"block {i}'s {why}"
    return None


def _moe_why_not(mlp: MoE) -> str | None:
    """Why the C step cannot run this MoE MLP (None: it can): it takes softmax top-k routing
    without biases, and routed SiLU-gated experts only."""
    s = mlp.gate.spec
    if s.scoring != "softmax" or s.topk_method != "greedy" or s.routed_scaling_factor != 1.0:
        return f"MoE routes by {s.scoring} / {s.topk_method} (the fused step: softmax top-k)"
    if s.bias or s.glu is not None or s.act != "silu":
        return "MoE has expert biases or a clamped SwiGLU"
    if hasattr(mlp, "shared_experts"):
        return "MoE has shared experts"
    return None


def _norm_weight(norm: RMSNorm) -> torch.Tensor:
    return norm.scale().contiguous()


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
        j = net.rope_of_layer[i]
        mla = type(attn) is MLAAttention
        post = [(_norm_weight(n), n.eps) for n in _post_norms(layer)] if layer.post_norms else None
        out.append(
            Block(
                norm1=_norm_weight(layer.input_layernorm),
                eps1=layer.input_layernorm.eps,
                norm2=_norm_weight(layer.post_attention_layernorm),
                eps2=layer.post_attention_layernorm.eps,
                o=attn.o_proj.weight,
                o_bias=attn.o_proj.bias,
                gate_up=getattr(mlp, "gate_up_proj", None) and mlp.gate_up_proj.weight,
                gate_up_bias=getattr(mlp, "gate_up_proj", None) and mlp.gate_up_proj.bias,
                down=getattr(mlp, "down_proj", None) and mlp.down_proj.weight,
                down_bias=getattr(mlp, "down_proj", None) and mlp.down_proj.bias,
                rope=j,
                rope_half=0 if j is None else net.rotaries[j].cos.shape[-1],
                interleaved=attn.interleaved,
                act=getattr(mlp, "act", "silu"),  # (MoE: its experts' SiLU)
                intermediate=0 if type(mlp) is MoE else mlp.down_proj.in_features,
                moe=_experts(mlp) if type(mlp) is MoE else None,
                post_norms=post,
                **(_latent(attn, net.kv_cache.layer(i)) if mla else _gqa(attn, net, i)),
            )
        )
    tied = net.lm_head.tied_to[0]
    final = net.model.norm
    head = None
    # the final norm and the head join the call where they are the core's own (a subclass,
    # such as tensor parallelism's gathering head, runs as a module after the call)
    if type(final) is RMSNorm and type(net.lm_head) is LMHead:
        head = (
            _norm_weight(final),
            final.eps,
            tied.weight if tied is not None else net.lm_head.weight,
        )
    return Blocks.build(out, net.config.hidden_size, head)


def _gqa(attn: GQAAttention, net: CausalLM, i: int) -> dict:
    """A GQA block's attention fields of its `Block`."""
    s = attn.spec
    k, v = net.kv_cache.layer(i)
    return dict(
        qkv=attn.qkv_proj.weight,
        qkv_bias=attn.qkv_proj.bias,
        k_cache=k,
        v_cache=v,
        ring=s.window is not None,
        heads=s.num_heads,
        kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        scale=s.scale,
        softcap=s.softcap,
        sinks=attn.sinks if s.sinks else None,
        qk_norm=_qk_norm(attn),
    )


def _latent(attn: MLAAttention, cache: tuple[torch.Tensor, ...]) -> dict:
    """An MLA block's attention fields of its `Block`: its heads in place of q|k|v, its
    latent and k_pe caches (as the cache lays them out) in place of k / v."""
    s = attn.spec
    q_a = getattr(attn, "q_a_proj", None)
    latent, k_pe = cache
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
    return dict(qkv=None, qkv_bias=None, k_cache=None, v_cache=None, ring=False,
                heads=s.num_heads, kv_heads=s.num_heads, head_dim=s.v_head_dim, scale=s.scale,
                softcap=None, sinks=None, mla=mla)  # fmt: skip


def _qk_norm(attn: GQAAttention) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    if attn.spec.qk_norm is None:
        return None
    return _norm_weight(attn.q_norm), _norm_weight(attn.k_norm), attn.q_norm.eps


def _experts(mlp: MoE) -> Experts:
    s, ex = mlp.gate.spec, mlp.experts
    return Experts(
        router=mlp.gate.weight,
        top_k=s.top_k,
        renorm=s.norm_topk_prob,
        intermediate=s.intermediate_size,
        gate_up=ex.gate_up_proj.weight,
        down=ex.down_proj.weight,
    )


def _first_weight(net: CausalLM) -> torch.Tensor:
    attn = net.model.layers[0].self_attn
    w = attn.o_proj.weight  # (every attention kind has one)
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
            return "no C compiler for kernels/cpu_decode.c"
        if self._blocks() is None:
            return "a weight or cache tensor the C step cannot read"
        return None

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
        if rows is not None:  # the C step writes where these point: check them first
            rows = rows.to(torch.int64).contiguous()
            at, top = rows.tolist(), net.kv_cache.max_batch_size
            if len(at) != b or len(set(at)) != b or not 0 <= min(at) <= max(at) < top:
                raise IndexError(f"cache rows {at} for {b} tokens ({top} rows, each once)")
        h = net.model.embed_tokens(tokens[:, None]).reshape(b, -1).contiguous()
        pos = positions.to(torch.int64).contiguous()
        tables = [tuple(t.contiguous() for t in rotary(pos, 1, end)) for rotary in net.rotaries]
        logits = fused(h, pos, tables, rows)
        return net.head(h[:, None])[:, -1] if logits is None else net.scale_logits(logits)
