"""Ministral 3 (`ministral3`) and Mistral 3 (`mistral3`: the multimodal repos, whose
`text_config` is a ministral3 or a mistral text model), as deltas of Mistral.

Ministral 3 differs from Mistral by its rope (YaRN by default) and by a per-position scale of
the queries after rope (`rope_parameters.llama_4_scaling_beta`, Llama 4's attention
temperature): q at position p is multiplied by 1 + beta * log(1 + floor(p /
original_max_position_embeddings)), 1 until the original context length
(`GQASpec.query_scale`). The checkpoint names are Llama's; a mistral3 checkpoint's vision
tower and projector are skipped at load.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import NonNegativeInt, PositiveInt

from core.config import GQASpec, QueryScale
from core.errors import ConfigError
from core.hfconfig import text_model, text_model_weights
from core.hookspecs import hookimpl
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP
from plugins.mistral import MistralConfig

# transformers' Ministral3Config's rope when config.json gives none
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16384,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}
TEXT_MODELS = ("ministral3", "mistral")  # a mistral3 config's text_config.model_type


class Ministral3Config(MistralConfig):
    """Ministral 3's text model. Defaults are transformers' Ministral3Config's (the 8B's)."""

    model_type: Literal["ministral3"] = "ministral3"
    vocab_size: PositiveInt = 131072
    hidden_size: PositiveInt = 4096
    intermediate_size: PositiveInt = 14336
    num_hidden_layers: PositiveInt = 34
    num_attention_heads: PositiveInt = 32
    num_key_value_heads: PositiveInt | None = 8
    head_dim: PositiveInt | None = 128
    max_position_embeddings: PositiveInt = 262144
    rms_norm_eps: float = 1e-5
    bos_token_id: NonNegativeInt | None = 1
    eos_token_id: NonNegativeInt | list[NonNegativeInt] | None = 2

    def default_rope(self) -> dict[str, Any] | None:
        """The rope when config.json gives none (None: rope_theta alone, as Mistral)."""
        return DEFAULT_ROPE  # differs from mistral: YaRN unless told otherwise

    def rope_params(self) -> tuple[str, dict[str, Any]]:
        default = self.default_rope()
        if self.rope_parameters is None and self.rope_scaling is None and default:
            params = dict(default)
            return params.pop("rope_type"), params
        return super().rope_params()

    def query_scale(self) -> QueryScale | None:
        """The queries' per-position scale; None: none (beta absent or 0)."""
        _, params = self.rope_params()
        beta = params.get("llama_4_scaling_beta")
        if not beta:
            return None
        period = params.get("original_max_position_embeddings")
        if not isinstance(period, int) or period < 1:
            raise ConfigError(
                "config.json: rope_parameters.llama_4_scaling_beta scales queries per "
                "original_max_position_embeddings positions, but that field is "
                f"{period!r}; set it to the pre-YaRN context length (a positive integer)"
            )
        return QueryScale(float(beta), period)

    def attention_spec(self) -> GQASpec:
        return replace(super().attention_spec(), query_scale=self.query_scale())


class Mistral3Config(Ministral3Config):
    """A multimodal Mistral 3 (Ministral 3, Mistral Small 3.1 / 3.2, Magistral, Devstral): its
    `text_config` (ministral3 or mistral) is the text model Zoo runs; the top level's
    `tie_word_embeddings` decides tying, true when absent (as transformers' Mistral3Config)."""

    model_type: Literal["mistral3"] = "mistral3"
    text_model_type: Literal["ministral3", "mistral"] = "ministral3"
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> Mistral3Config:
        text = text_model(raw, source, "mistral3")
        kind = raw["text_config"].get("model_type", "mistral")  # transformers' default
        if kind not in TEXT_MODELS:
            raise ConfigError(
                f"{source}: field 'text_config.model_type' is {kind!r}; a mistral3 text model "
                f"Zoo runs is one of {', '.join(TEXT_MODELS)}"
            )
        top = {"tie_word_embeddings": raw.get("tie_word_embeddings", True)}
        return super().from_dict({**text, **top, "text_model_type": kind}, source)

    def default_rope(self) -> dict[str, Any] | None:
        return DEFAULT_ROPE if self.text_model_type == "ministral3" else None

    def query_scale(self) -> QueryScale | None:
        # a mistral text model (Mistral Small 3.1) scales no queries, whatever its rope says
        return super().query_scale() if self.text_model_type == "ministral3" else None


# a mistral3 checkpoint's text model under the hub's names (language_model.model.*) or
# transformers 5's (model.language_model.*); the vision tower and projector are not run
MISTRAL3_WEIGHT_MAP = text_model_weights(
    LLAMA3_WEIGHT_MAP, ("vision_tower", "multi_modal_projector")
)


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture("ministral3", Ministral3Config, dict(LLAMA3_WEIGHT_MAP))
    registry.add_architecture("mistral3", Mistral3Config, MISTRAL3_WEIGHT_MAP)
