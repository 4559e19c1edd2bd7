"""The Gemma family: Gemma (`gemma`), Gemma 2 (`gemma2`) and Gemma 3's text model
(`gemma3_text`, and a multimodal `gemma3` config's `text_config`), each a delta of the one
before, Gemma a delta of Llama 3.

All three share the checkpoint names of Llama plus Gemma 2's sandwich norms, and three core
kinds Llama does not use: the (1 + w) RMSNorm computed in fp32 (`RMSNormSpec(offset=1)`), the
GeGLU MLP with tanh GELU (`DenseMLPSpec(act="gelu_tanh")`) and embeddings times
sqrt(hidden_size) rounded to the model dtype (`EmbeddingSpec.scale`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import PositiveFloat, PositiveInt

from core.config import DefaultRope, DenseMLPSpec, EmbeddingSpec, GQASpec, RMSNormSpec, RopeSpec
from core.errors import ConfigError
from core.hfconfig import DecoderConfig, text_model, text_model_weights
from core.hookspecs import hookimpl
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP

GELU_TANH = Literal["gelu", "gelu_pytorch_tanh"]  # the released configs' legacy "gelu" is tanh


class GemmaConfig(DecoderConfig):
    """Gemma v1. Defaults are transformers' GemmaConfig's."""

    model_type: Literal["gemma"] = "gemma"
    # differs from llama3: GELU with the tanh approximation; `hidden_activation` is the older key
    hidden_act: GELU_TANH = "gelu_pytorch_tanh"
    hidden_activation: GELU_TANH | None = None
    head_dim: PositiveInt = 256  # differs from llama3: explicit, not hidden / heads
    tie_word_embeddings: bool = True

    def norm_spec(self) -> RMSNormSpec:
        return RMSNormSpec(self.rms_norm_eps, offset=1.0)  # differs from llama3: (1 + w), fp32

    def mlp_spec(self) -> DenseMLPSpec:
        return DenseMLPSpec(self.intermediate_size, act="gelu_tanh")  # differs: GeGLU

    def embedding_spec(self) -> EmbeddingSpec:
        # differs from llama3: embeddings times sqrt(hidden_size), rounded to the model dtype
        return EmbeddingSpec(scale=self.hidden_size**0.5)


class Gemma2Config(GemmaConfig):
    """Gemma 2. Defaults are transformers' Gemma2Config's."""

    model_type: Literal["gemma2"] = "gemma2"
    # differs from gemma: softmax scale query_pre_attn_scalar ** -0.5, not head_dim ** -0.5
    query_pre_attn_scalar: PositiveFloat = 256
    # differs from gemma: tanh soft-caps on attention scores and on the final logits
    attn_logit_softcapping: PositiveFloat | None = 50.0
    final_logit_softcapping: PositiveFloat | None = 30.0
    sliding_window: PositiveInt | None = 4096

    def default_layer_kinds(self) -> list[str]:
        # differs from gemma: windowed and global layers alternate, layer 0 windowed
        n = self.num_hidden_layers
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]

    def attention_spec(self) -> GQASpec:
        return replace(
            super().attention_spec(),
            softmax_scale=self.query_pre_attn_scalar**-0.5,
            softcap=self.attn_logit_softcapping,
        )

    def final_softcap(self) -> float | None:
        return self.final_logit_softcapping

    def post_norms(self) -> bool:
        return True  # differs from gemma: norms after attention and after the MLP too


class Gemma3TextConfig(Gemma2Config):
    """Gemma 3's text model. Defaults are transformers' Gemma3TextConfig's."""

    model_type: Literal["gemma3_text"] = "gemma3_text"
    vocab_size: PositiveInt = 262208
    hidden_size: PositiveInt = 2304
    intermediate_size: PositiveInt = 9216
    num_hidden_layers: PositiveInt = 26
    num_attention_heads: PositiveInt = 8
    num_key_value_heads: PositiveInt | None = 4
    max_position_embeddings: PositiveInt = 131072
    # differs from gemma2: no soft-caps by default (the releases set none)
    attn_logit_softcapping: PositiveFloat | None = None
    final_logit_softcapping: PositiveFloat | None = None
    # differs from gemma2: window layers use their own rope base; only global layers get the
    # model's theta and its scaling (`rope_scaling`)
    rope_local_base_freq: PositiveFloat = 10000.0
    # differs from gemma2: five window layers to one global (absent `layer_types`)
    sliding_window_pattern: PositiveInt = 6
    default_rope_theta = 1_000_000.0

    def default_layer_kinds(self) -> list[str]:
        p, n = self.sliding_window_pattern, self.num_hidden_layers
        return ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(n)]

    def attention_spec(self) -> GQASpec:
        # differs from gemma2: q and k normed per head over head_dim, with the (1 + w) norm
        return replace(super().attention_spec(), qk_norm=self.norm_spec())

    def _per_kind(self) -> dict[str, Any] | None:
        """transformers 5 writes one rope block per layer kind; None: the older flat keys."""
        p = self.rope_parameters
        return p if p and ("full_attention" in p or "sliding_attention" in p) else None

    def rope_params(self) -> tuple[str, dict[str, Any]]:
        per_kind = self._per_kind()
        if per_kind is None:
            return super().rope_params()
        params = dict(per_kind.get("full_attention") or {})
        kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
        return kind, params

    def local_rope(self) -> RopeSpec:
        """The window layers' rope: plain, at rope_local_base_freq (or transformers 5's
        rope_parameters.sliding_attention)."""
        local = dict((self._per_kind() or {}).get("sliding_attention") or {})
        kind = local.get("rope_type", "default")
        if kind != "default":
            raise ConfigError(
                f"config.json: field 'rope_parameters.sliding_attention.rope_type' is {kind!r}; "
                "Gemma 3's window layers use plain rope ('default')"
            )
        theta = local.get("rope_theta", self.rope_local_base_freq)
        return DefaultRope(theta=float(theta), dim=self.rope_dim())

    def attention_layers(self, base: Any) -> tuple[Any, ...]:
        local = self.local_rope()
        return tuple(
            replace(spec, rope=local) if spec.window is not None else spec
            for spec in super().attention_layers(base)
        )


class Gemma3Config(Gemma3TextConfig):
    """A multimodal Gemma 3 (`gemma3`, 4B and up): its `text_config` is the text model Zoo runs;
    the vision tower and projector are skipped at load (GEMMA3_WEIGHT_MAP)."""

    model_type: Literal["gemma3"] = "gemma3"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> Gemma3Config:
        return super().from_dict(text_model(raw, source, "gemma3"), source)


# differs from llama3: Gemma 2's norm after attention is stored as post_attention_layernorm,
# the name the core gives the norm before the MLP (Gemma's pre_feedforward_layernorm)
WEIGHT_MAP = dict(LLAMA3_WEIGHT_MAP)
GEMMA2_WEIGHT_MAP = {
    **WEIGHT_MAP,
    "model.layers.{}.post_attention_layernorm": "model.layers.{}.attn_out_layernorm",
    "model.layers.{}.pre_feedforward_layernorm": "model.layers.{}.post_attention_layernorm",
}

# a gemma3 checkpoint's text model under the hub's names (language_model.model.*) or
# transformers 5's (model.language_model.*); the vision tower and projector are not run
GEMMA3_WEIGHT_MAP = text_model_weights(GEMMA2_WEIGHT_MAP, ("vision_tower", "multi_modal_projector"))


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture("gemma", GemmaConfig, WEIGHT_MAP)
    registry.add_architecture("gemma2", Gemma2Config, GEMMA2_WEIGHT_MAP)
    registry.add_architecture("gemma3_text", Gemma3TextConfig, GEMMA2_WEIGHT_MAP)
    registry.add_architecture("gemma3", Gemma3Config, GEMMA3_WEIGHT_MAP)
