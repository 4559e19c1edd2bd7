"""Layer primitives the generic decoder block is assembled from."""

from core.layers.attention import GQAAttention
from core.layers.embedding import Embedding, LMHead
from core.layers.linear import FusedLinear, Linear
from core.layers.mla import MLAAttention
from core.layers.mlp import GatedMLP
from core.layers.moe import MoE
from core.layers.norm import RMSNorm
from core.layers.rope import RotaryEmbedding

__all__ = [
    "Embedding",
    "FusedLinear",
    "GQAAttention",
    "GatedMLP",
    "LMHead",
    "Linear",
    "MLAAttention",
    "MoE",
    "RMSNorm",
    "RotaryEmbedding",
]
