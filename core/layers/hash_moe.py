"""DeepSeek V4's MoE: sqrt(softplus) router scores, clamped SwiGLU experts, and hash routing.

Differs from core.layers.moe's MoE: the routed AND the shared experts clamp their gate to at
most `swiglu_limit` and their up to [-limit, limit] before silu(gate) * up; and on the
`hash_layers` (the first few) the experts a token goes to are a fixed table of its token id
(`tid2eid`, (vocab, top_k)), while the learned gate still weighs them. So the layer takes
the token ids beside the hidden states.
"""

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from core.config import MoESpec
from core.layers.mlp import GatedMLP
from core.layers.moe import Experts, Router


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """[gate | up] -> silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class HashRouter(nn.Module):
    """Experts by token id (tid2eid), weighted by the gate's sqrt(softplus) scores of them,
    renormalised and scaled as the learned router's."""

    def __init__(self, hidden: int, spec: MoESpec, vocab: int):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden))
        # expert ids, stored as floats (exact up to 2**24) so the loader fills it like a weight
        self.tid2eid = nn.Parameter(torch.zeros(vocab, spec.top_k), requires_grad=False)
        self.tid2eid.keep_fp32 = True

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softplus(F.linear(x.float(), self.weight.float())).sqrt()  # (N, E)
        experts = self.tid2eid[ids].long()  # (N, K)
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.spec.routed_scaling_factor


class HashMoE(nn.Module):
    """out = sum_k w_k * clamped_expert_k(x) + clamped_shared(x)."""

    def __init__(self, hidden: int, spec: MoESpec, vocab: int, hashed: bool):
        super().__init__()
        plain = replace(spec, swiglu_limit=None, hash_layers=())  # for the shared parts
        self.limit = spec.swiglu_limit if spec.swiglu_limit is not None else float("inf")
        self.gate = HashRouter(hidden, spec, vocab) if hashed else Router(hidden, plain)
        self.experts = Experts(hidden, plain)
        self.shared_experts = GatedMLP(hidden, plain.shared)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, hidden)
        if isinstance(self.gate, HashRouter):
            experts, weights = self.gate(flat, ids.reshape(-1))
        else:
            experts, weights = self.gate(flat)
        gate_up, down = self.experts.gate_up_proj.weight, self.experts.down_proj.weight
        out = torch.zeros_like(flat)
        for e in experts.unique().tolist():
            token, slot = (experts == e).nonzero(as_tuple=True)
            h = clamped_swiglu(flat[token] @ gate_up[e].T, self.limit) @ down[e].T
            out.index_add_(0, token, (h * weights[token, slot, None]).to(out.dtype))
        shared = self.shared_experts
        return out.view(shape) + shared.down_proj(
            clamped_swiglu(shared.gate_up_proj(x), self.limit)
        )
