"""Per-layer embeddings (Gemma 4's PLE, `PerLayerInputSpec`): a second, narrow input for every
layer, made once per forward from the token ids and their embeddings (`PerLayerEmbeddings`), and
added by each block after its MLP (`PerLayerInput`)."""

import torch
import torch.nn.functional as F
from torch import nn

from core.config import EmbeddingSpec
from core.config_kinds import PerLayerInputSpec
from core.layers.embedding import Embedding
from core.layers.linear import Linear
from core.plugins import registry


class PerLayerEmbeddings(nn.Module):
    """ids (B, T) and their embeddings x0 (B, T, hidden) -> (B, T, layers, dim):
    (norm(x0 @ W * hidden ** -0.5) + E[ids] * sqrt(dim)) / sqrt(2), the norm over dim."""

    def __init__(self, hidden: int, layers: int, spec: PerLayerInputSpec):
        super().__init__()
        self.layers, self.dim, self.hidden = layers, spec.dim, hidden
        width = layers * spec.dim  # all layers' inputs packed in one row
        scale = EmbeddingSpec(spec.dim**0.5)  # sqrt(dim), rounded to the model dtype
        self.embed_tokens_per_layer = Embedding(spec.vocab_size, width, scale)
        self.per_layer_model_projection = Linear(hidden, width, bias=False)
        self.per_layer_projection_norm = registry().layer(spec.norm)(spec.dim, spec.norm)

    def forward(self, ids: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        shape = (*ids.shape, self.layers, self.dim)
        proj = self.per_layer_model_projection(x0) * self.hidden**-0.5
        proj = self.per_layer_projection_norm(proj.reshape(shape))
        return (proj + self.embed_tokens_per_layer(ids).reshape(shape)) * 2**-0.5


class PerLayerInput(nn.Module):
    """A block's use of its input p (B, T, dim): h -> h + norm(proj(gelu_tanh(gate(h)) * p))."""

    def __init__(self, hidden: int, spec: PerLayerInputSpec):
        super().__init__()
        self.gate = Linear(hidden, spec.dim, bias=False)
        self.proj = Linear(spec.dim, hidden, bias=False)
        self.norm = registry().layer(spec.norm)(hidden, spec.norm)

    def forward(self, h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return h + self.norm(self.proj(F.gelu(self.gate(h), approximate="tanh") * p))
