"""StableLM 2's config.json -> Zoo's RuntimeConfig, as a delta of Llama 3. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Literal

from pydantic import Field, PositiveFloat

from core.config import GQASpec
from core.errors import ConfigError
from core.hfconfig import DecoderConfig


# --- the layer kind StableLM adds (its module is in zoo_stablelm/layers.py) -------------------
@dataclass(frozen=True)
class LayerNormSpec:
    """(x - mean(x)) / sqrt(var(x) + eps) * weight + bias: a LayerNorm, not an RMSNorm."""

    eps: float


class StableLmConfig(DecoderConfig):
    """Defaults are transformers' StableLmConfig's."""

    model_type: Literal["stablelm"] = "stablelm"
    # differs from llama3: LayerNorm (with a bias) everywhere, its own eps key
    layer_norm_eps: PositiveFloat = 1e-5
    # differs from llama3: rope turns only the first quarter of each head by default
    partial_rotary_factor: Annotated[float, Field(gt=0, le=1)] = 0.25
    use_qkv_bias: bool = False  # differs from llama3: q/k/v biases, o_proj none
    # the StableLM variants Zoo's pre-norm block cannot run are refused by name
    qk_layernorm: bool = False
    use_parallel_residual: bool = False

    def norm_spec(self) -> LayerNormSpec:
        return LayerNormSpec(self.layer_norm_eps)

    def attention_spec(self) -> GQASpec:
        for name in ("qk_layernorm", "use_parallel_residual"):
            if getattr(self, name):
                raise ConfigError(
                    f"config.json: field '{name}' is true, which zoo-stablelm does not run "
                    "(StableLM 2 1.6B / Zephyr leave it false)"
                )
        return replace(super().attention_spec(), qkv_bias=self.use_qkv_bias, o_bias=False)

    def rope_dim(self) -> int:
        # the core's partial-rotary helper (transformers 5 may move the factor into
        # rope_parameters; that one wins)
        return self.partial_rope_dim(self.partial_rotary_factor)
