"""Granite's two layer kinds: the core's GQA attention and SwiGLU MLP, each output multiplied
by `residual_multiplier` before the block adds it to the residual stream."""

from core.layers.attention import GQAAttention
from core.layers.mlp import GatedMLP


class GraniteAttention(GQAAttention):
    def forward(self, x, *args, **kwargs):
        return super().forward(x, *args, **kwargs) * self.spec.residual_multiplier


class GraniteMLP(GatedMLP):
    def __init__(self, hidden, spec):
        super().__init__(hidden, spec)
        self.residual_multiplier = spec.residual_multiplier

    def forward(self, x):
        return super().forward(x) * self.residual_multiplier
