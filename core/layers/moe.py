"""Mixture of experts: a router, stacked routed experts, and optional shared experts.

One layer for every MoE architecture (DeepSeek V2/V3, Mixtral, Qwen3-MoE, gpt-oss); they differ
only in their `MoESpec` (scoring, top-k method, renormalisation, shared experts, biases, the
activation).

Hub checkpoints store each expert separately (`mlp.experts.7.gate_proj.weight`); the core keeps
them stacked, `experts.gate_up_proj.weight` (E, 2I, H) and `experts.down_proj.weight` (E, H, I),
with one named shard per expert slice ("7.gate", "7.up", "7") for the loader to fill, or filled
whole from a checkpoint that stores them stacked (transformers 5's `mlp.experts.gate_up_proj`).
"""

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from core.config import MoESpec
from core.layers.linear import Linear
from core.layers.mlp import GatedMLP, relu2


def route(
    logits: torch.Tensor, spec: MoESpec, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (N, E) fp32 -> (topk_ids (N, K), topk_weights (N, K) fp32).

    See `MoESpec` for the methods; `correction_bias` (E,) is noaux_tc's e_score_correction_bias.
    """
    if spec.scoring == "sqrtsoftplus":  # DeepSeek V4
        scores = F.softplus(logits).sqrt()
    else:
        scores = logits.softmax(-1) if spec.scoring == "softmax" else logits.sigmoid()
    n, e, g = scores.shape[0], spec.num_experts, spec.num_groups
    if spec.topk_method == "greedy":
        weights, ids = scores.topk(spec.top_k, dim=-1, sorted=False)
    else:
        choice = scores if correction_bias is None else scores + correction_bias
        grouped = choice.view(n, g, e // g)  # (N, groups, experts per group)
        if spec.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:  # group_limited_greedy
            group_scores = grouped.max(dim=-1).values
        keep = group_scores.topk(spec.topk_groups, dim=-1, sorted=False)[1]  # (N, topk_groups)
        mask = torch.zeros_like(group_scores).scatter_(1, keep, 1).bool()
        mask = mask[:, :, None].expand(n, g, e // g).reshape(n, e)
        # noaux_tc masks with -inf (transformers, vLLM), since biased scores may be negative
        fill = float("-inf") if spec.topk_method == "noaux_tc" else 0.0
        ids = choice.masked_fill(~mask, fill).topk(spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)  # the unbiased scores
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * spec.routed_scaling_factor


class Router(nn.Module):
    """The gate: logits = x @ W.T in fp32, then `route`. noaux_tc adds a correction bias."""

    def __init__(self, hidden: int, spec: MoESpec):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden))
        if spec.router_fp32:  # Nemotron-H: the checkpoint's fp32 router is not rounded
            self.weight.keep_fp32 = True
        if spec.bias:  # gpt-oss: logits = x @ W.T + b
            self.bias = nn.Parameter(torch.empty(spec.num_experts))
        if spec.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(spec.num_experts))
            self.e_score_correction_bias.keep_fp32 = True  # small differences decide routing

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = getattr(self, "bias", None)
        logits = F.linear(x.float(), self.weight.float(), None if b is None else b.float())
        bias = getattr(self, "e_score_correction_bias", None)
        return route(logits, self.spec, None if bias is None else bias.float())


class StackedLinear(nn.Module):
    """E linear maps in one (E, out, in) weight. Shard "e" is expert e's whole matrix; with
    named parts (gate, up), shard "e.gate" is its rows of that part. Shard "T" is the whole
    weight stored transposed, (E, in, out) (gpt-oss's checkpoints). With `bias`, an (E, out)
    bias, filled whole."""

    def __init__(self, num: int, in_features: int, out: int | dict[str, int], bias=False):
        super().__init__()
        parts = out if isinstance(out, dict) else None
        rows = sum(parts.values()) if parts else out
        self.weight = nn.Parameter(torch.empty(num, rows, in_features))
        if bias:
            self.bias = nn.Parameter(torch.empty(num, rows))
        shards = {}
        for e in range(num):
            if parts is None:
                shards[str(e)] = (e,)
                continue
            offset = 0
            for name, size in parts.items():
                shards[f"{e}.{name}"] = (e, slice(offset, offset + size))
                offset += size
        shards["T"] = _transposed  # a view: the loader writes through it
        self.weight.shards = shards


def _transposed(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(-1, -2)


class Experts(nn.Module):
    """The routed experts; gate_up's rows are [gate | up], or interleaved (gate, up) pairs
    when `spec.glu` is set (gpt-oss keeps them so, and its activation reads them so). Not
    `spec.gated` (Nemotron-H): up_proj alone, down(relu2(up(x)))."""

    def __init__(self, hidden: int, spec: MoESpec):
        super().__init__()
        i, b = spec.intermediate_size, spec.bias
        self.glu, self.scale_input, self.act = spec.glu, spec.scale_input, spec.act
        self.gated = spec.gated
        if spec.gated and spec.act == "relu2":  # (its kernel would run SiLU, silently)
            raise ValueError("relu2 experts are non-gated ones: MoESpec(gated=False)")
        if spec.gated:
            self.gate_up_proj = StackedLinear(spec.num_experts, hidden, {"gate": i, "up": i}, b)
        elif spec.act != "relu2" or spec.glu is not None or b:
            raise ValueError("non-gated experts are relu2 ones, without glu nor biases")
        else:
            self.up_proj = StackedLinear(spec.num_experts, hidden, i)
        self.down_proj = StackedLinear(spec.num_experts, i, hidden, b)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.scale_input:  # Llama 4: sum_k expert_k(w_k * x), each expert at weight 1
            ones = torch.ones_like(weights[:, :1])
            parts = [self.run(x * weights[:, k : k + 1].to(x.dtype), ids[:, k : k + 1], ones)
                     for k in range(ids.shape[1])]  # fmt: skip
            return torch.stack(parts).sum(0)
        return self.run(x, ids, weights)

    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k w_k * expert_k(x): the experts' kernel."""
        if not self.gated:  # Nemotron-H's relu2 experts: no kernel of their own yet
            return _loop_experts(x, ids, weights, self.up_proj.weight, self.down_proj.weight)
        gate_up, down = self.gate_up_proj, self.down_proj
        if self.act == "gelu_tanh":  # GeGLU experts (Gemma 4): no kernel of their own yet
            return _loop_experts(x, ids, weights, gate_up.weight, down.weight, _geglu)
        if self.glu is None and not hasattr(gate_up, "bias"):
            return kernels.moe_experts(x, ids, weights, gate_up.weight, down.weight)
        clamp = None if self.glu is None else (self.glu.alpha, self.glu.limit)
        biases = (getattr(gate_up, "bias", None), getattr(down, "bias", None))
        return kernels.moe_experts(x, ids, weights, gate_up.weight, down.weight, *biases, clamp)


def _geglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _loop_experts(x, ids, weights, first, down, act=relu2) -> torch.Tensor:
    """kernels.moe_experts' loop with another activation: sum_k w_k * down_e(act(first_e(x)))
    for the GeGLU experts of Gemma 4 (first: gate_up) and the relu2 ones of Nemotron-H
    (first: up): (N, H) in x's dtype. Each expert's output is weighted in fp32; Gemma 4's
    rounded before the sum, Nemotron-H's summed in fp32 and rounded once (as transformers'
    Gemma4TextExperts and NemotronHExperts)."""
    sum_dtype = weights.dtype if act is relu2 else x.dtype
    out = torch.zeros_like(x, dtype=sum_dtype)
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        h = _expert(act(_expert(x[token], first, e)), down, e)
        out.index_add_(0, token, (h * weights[token, slot, None]).to(sum_dtype))
    return out.to(x.dtype)


def _expert(h: torch.Tensor, w, e: int) -> torch.Tensor:
    """h @ expert e's (out, in) matrix of a stack: floats, GGML blocks kept on CPUs
    (`BlockExperts`: kernels.linear of expert e's weight) or fp8 / MXFP4 kept (dequantized)."""
    if isinstance(w, torch.Tensor):
        return h @ w[e].T
    if hasattr(w, "experts"):
        return kernels.linear(h, w[e])
    return h @ w.dequantize(e).to(h.dtype).T


class MoE(nn.Module):
    """out = sum_k w_k * expert_k(x) + shared_experts(x), the shared part times
    sigmoid(shared_expert_gate(x)) when `spec.shared_gate` (Qwen3-Next, Qwen3.5)."""

    def __init__(self, hidden: int, spec: MoESpec):
        super().__init__()
        if spec.swiglu_limit is not None or spec.hash_layers:
            raise ValueError("a clamped or hash-routed MoESpec is core.layers.hash_moe's")
        self.gate = Router(hidden, spec)
        self.experts = Experts(hidden, spec)
        if spec.shared_width:
            self.shared_experts = GatedMLP(hidden, spec.shared)
        if spec.shared_gate:
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, hidden)
        ids, weights = self.gate(flat)
        out = self.experts(flat, ids, weights).view(shape)
        if hasattr(self, "shared_experts"):
            shared = self.shared_experts(x)
            if hasattr(self, "shared_expert_gate"):
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
