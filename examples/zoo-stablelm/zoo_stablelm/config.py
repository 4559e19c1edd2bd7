"""Gemma's config.json -> Zoo's RuntimeConfig, as a delta of Llama 3. No torch here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import PositiveInt

from core.config import EmbeddingSpec
from core.hfconfig import DecoderConfig


# --- the layer kinds Gemma adds (their modules are in zoo_gemma/layers.py) -------------------
@dataclass(frozen=True)
class GemmaRMSNormSpec:
    """x / sqrt(mean(x^2) + eps) * (1 + weight), all in fp32, then cast back."""

    eps: float


@dataclass(frozen=True)
class GeGLUSpec:
    """down(gelu_tanh(gate(x)) * up(x)), no biases."""

    intermediate_size: int


class GemmaConfig(DecoderConfig):
    """Defaults are transformers' GemmaConfig's."""

    model_type: Literal["gemma"] = "gemma"
    # differs from llama3: gelu with the tanh approximation; transformers reads the released
    # configs' legacy "gelu" as tanh too, and `hidden_activation` (older key) the same way
    hidden_act: Literal["gelu", "gelu_pytorch_tanh"] = "gelu_pytorch_tanh"
    hidden_activation: Literal["gelu", "gelu_pytorch_tanh"] | None = None
    head_dim: PositiveInt = 256  # differs from llama3: explicit, not hidden / heads
    tie_word_embeddings: bool = True

    def norm_spec(self) -> GemmaRMSNormSpec:
        return GemmaRMSNormSpec(self.rms_norm_eps)  # differs from llama3: scales by (1 + w)

    def mlp_spec(self) -> GeGLUSpec:
        return GeGLUSpec(self.intermediate_size)  # differs from llama3: GeGLU, not SwiGLU

    def embedding_spec(self) -> EmbeddingSpec:
        # differs from llama3: embeddings times sqrt(hidden_size), rounded to the model dtype
        return EmbeddingSpec(scale=self.hidden_size**0.5)
