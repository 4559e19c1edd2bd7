"""Gemma 4's MoE layer (`DenseMoESpec`): a dense GeGLU MLP beside routed GeGLU experts, each
between norms of its own, the router reading the block's un-normed residual stream."""

import torch
from torch import nn

from core.config_kinds import DenseMoESpec
from core.layers.linear import Linear
from core.layers.mlp import GatedMLP
from core.layers.moe import Experts, route
from core.plugins import registry


class ScaledRouter(nn.Module):
    """h -> (ids, weights): weightless RMSNorm(h) in fp32, times `scale` and hidden ** -0.5,
    through `proj`; softmax top-k renormalised (fp32), each weight times per_expert_scale."""

    def __init__(self, hidden: int, spec: DenseMoESpec):
        super().__init__()
        self.spec, self.eps = spec.moe, spec.norm.eps
        self.proj = Linear(hidden, spec.moe.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(spec.moe.num_experts))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hf = h.float()
        normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps)).to(h.dtype)
        logits = self.proj(normed * self.scale * h.shape[-1] ** -0.5)
        ids, weights = route(logits.float(), self.spec)
        return ids, weights * self.per_expert_scale[ids].float()


class DenseMoE(GatedMLP):
    """The dense MLP's parameters are GatedMLP's own (the same checkpoint names as a dense
    layer's); the router, experts and the three extra norms sit beside them."""

    residual_input = True  # forward(x, h): the block passes its un-normed stream too

    def __init__(self, hidden: int, spec: DenseMoESpec):
        super().__init__(hidden, spec.dense)
        norm = registry().layer(spec.norm)
        self.post_norm_1 = norm(hidden, spec.norm)
        self.pre_norm_2 = norm(hidden, spec.norm)
        self.post_norm_2 = norm(hidden, spec.norm)
        self.router = ScaledRouter(hidden, spec)
        self.experts = Experts(hidden, spec.moe)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])  # (N, hidden)
        ids, weights = self.router(flat)
        routed = self.experts(self.pre_norm_2(flat), ids, weights).view(h.shape)
        return self.post_norm_1(super().forward(x)) + self.post_norm_2(routed)
