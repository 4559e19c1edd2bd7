"""Granite 3.x dense (model_type `granite`) for Zoo, as a delta of Llama 3.

Granite is Llama with four scalar multipliers: the embeddings (`embedding_multiplier`), each
attention and MLP output before it joins the residual stream (`residual_multiplier`), the
attention scores (`attention_multiplier`, the softmax scale) and the logits (divided by
`logits_scaling`). The first, third and fourth are core options; the residual one is two layer
kinds this package registers (zoo_granite/layers.py). Zoo finds the plugin through the
`zoo.plugins` entry point in pyproject.toml. Importing it imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import PositiveFloat

from core.config import DenseMLPSpec, EmbeddingSpec, GQASpec
from core.hfconfig import DecoderConfig
from core.hookspecs import hookimpl
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP

__version__ = "0.1.0"


@dataclass(frozen=True)
class GraniteAttentionSpec(GQASpec):
    """GQA whose output is multiplied by `residual_multiplier` before the residual add."""

    residual_multiplier: float = 1.0


@dataclass(frozen=True)
class GraniteMLPSpec(DenseMLPSpec):
    """SwiGLU whose output is multiplied by `residual_multiplier` before the residual add."""

    residual_multiplier: float = 1.0


class GraniteConfig(DecoderConfig):
    """Defaults are transformers' GraniteConfig's."""

    model_type: Literal["granite"] = "granite"
    # differs from llama3: four multipliers
    embedding_multiplier: PositiveFloat = 1.0
    residual_multiplier: PositiveFloat = 1.0
    attention_multiplier: PositiveFloat = 1.0
    logits_scaling: PositiveFloat = 1.0

    def embedding_spec(self) -> EmbeddingSpec:
        return EmbeddingSpec(scale=self.embedding_multiplier)

    def attention_spec(self) -> GraniteAttentionSpec:
        spec = super().attention_spec()  # the softmax scale is attention_multiplier, not d^-0.5
        return GraniteAttentionSpec(
            **{**vars(spec), "softmax_scale": self.attention_multiplier},
            residual_multiplier=self.residual_multiplier,
        )

    def mlp_spec(self) -> GraniteMLPSpec:
        return GraniteMLPSpec(
            **vars(super().mlp_spec()), residual_multiplier=self.residual_multiplier
        )

    def logits_scale(self) -> float:
        return 1.0 / self.logits_scaling


# differs from llama3: nothing; the checkpoint names are Llama's
WEIGHT_MAP = dict(LLAMA3_WEIGHT_MAP)


@hookimpl
def zoo_register_layers(registry):
    # strings: torch is imported only when a model is built, never by `zoo plugins`
    registry.add_layer(GraniteAttentionSpec, "zoo_granite.layers:GraniteAttention")
    registry.add_layer(GraniteMLPSpec, "zoo_granite.layers:GraniteMLP")


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture("granite", GraniteConfig, WEIGHT_MAP)
