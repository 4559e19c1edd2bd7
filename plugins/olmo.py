"""OLMo 2 (`olmo2`) and OLMo 3 (`olmo3`), as deltas of Llama 3, OLMo 3 a delta of OLMo 2.

Differs from Llama 3 in the block: no norm before attention nor before the MLP; each
sub-block's output is normed before its residual add instead (`RuntimeConfig.pre_norms` off,
`post_norms` on), and q and k are normed over the whole projection, all heads together, before
the split into heads (`GQASpec.qk_norm_all_heads`). The norms multiply the fp32 normed x by
their weight before casting back (`RMSNormSpec.fp32_scale`). OLMo 3 adds sliding-window
layers (three in four by default) whose rope is plain, while the full layers take the model's
rope and its scaling (YaRN in the releases).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import NonNegativeInt, PositiveInt

from core.config import GQASpec, RMSNormSpec, RopeSpec
from core.hfconfig import LAYER_KINDS, DecoderConfig
from core.hookspecs import hookimpl
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP


class Olmo2Config(DecoderConfig):
    """OLMo 2. Defaults are transformers' Olmo2Config's."""

    model_type: Literal["olmo2"] = "olmo2"
    vocab_size: PositiveInt = 50304
    rms_norm_eps: float = 1e-5
    eos_token_id: NonNegativeInt | list[NonNegativeInt] | None = 50279

    def norm_spec(self) -> RMSNormSpec:
        # differs from llama3: the weight scales the fp32 normed x, then the cast back
        return RMSNormSpec(self.rms_norm_eps, fp32_scale=True)

    def attention_spec(self) -> GQASpec:
        # differs from llama3: q and k normed over all heads together (q_norm: num_heads *
        # head_dim, k_norm: num_kv_heads * head_dim)
        return replace(super().attention_spec(), qk_norm=self.norm_spec(), qk_norm_all_heads=True)

    def layer_windows(self) -> list[int | None]:
        return [None] * self.num_hidden_layers  # transformers' OLMo 2 has no window layers

    def pre_norms(self) -> bool:
        return False  # differs from llama3: no norm before attention nor before the MLP

    def post_norms(self) -> bool:
        return True  # differs from llama3: each sub-block's output is normed


class Olmo3Config(Olmo2Config):
    """OLMo 3. Defaults are transformers' Olmo3Config's."""

    model_type: Literal["olmo3"] = "olmo3"
    sliding_window: PositiveInt | None = 4096

    default_rope_theta: ClassVar[float] = 500000.0

    def layer_windows(self) -> list[int | None]:
        return DecoderConfig.layer_windows(self)  # differs from olmo2: window layers

    def default_layer_kinds(self) -> list[str]:
        # differs from olmo2: three window layers, then a full one
        n = self.num_hidden_layers
        return ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]

    def _per_kind(self) -> dict[str, Any] | None:
        """transformers 5 writes one rope block per layer kind; None: the older flat keys."""
        p = self.rope_parameters
        return p if p and any(k in p for k in LAYER_KINDS) else None

    def _rope_of(self, kind: str) -> RopeSpec:
        """The rope of one layer kind, built from its block by the generic reader."""
        per_kind = self._per_kind()
        if per_kind is None and kind == "full_attention":
            return super().rope_spec()  # rope_scaling / rope_parameters, top-level rope_theta
        if per_kind is None:
            # transformers: a top-level rope_theta (and rope_scaling) go to the full layers
            # only; the window layers keep the default theta
            block: dict[str, Any] = {"rope_type": "default"}
        else:
            block = dict(per_kind.get(kind) or {"rope_type": "default"})
            if kind == "full_attention" and self.rope_theta is not None:
                block.setdefault("rope_theta", self.rope_theta)
        block.setdefault("rope_theta", self.default_rope_theta)
        flat = self.model_copy(
            update={"rope_parameters": block, "rope_scaling": None, "rope_theta": None}
        )
        return DecoderConfig.rope_spec(flat)

    def rope_spec(self) -> RopeSpec:
        return self._rope_of("full_attention")

    def attention_layers(self, base: Any) -> tuple[Any, ...]:
        # differs from olmo2: the window layers' rope is their own (plain, not scaled)
        local = self._rope_of("sliding_attention")
        return tuple(
            replace(spec, rope=local) if spec.window is not None else spec
            for spec in super().attention_layers(base)
        )


# differs from llama3: the norm after attention is stored as post_attention_layernorm, the
# name the core gives the norm before the MLP (which OLMo has not)
WEIGHT_MAP = {
    **LLAMA3_WEIGHT_MAP,
    "model.layers.{}.post_attention_layernorm": "model.layers.{}.attn_out_layernorm",
}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture("olmo2", Olmo2Config, WEIGHT_MAP)
    registry.add_architecture("olmo3", Olmo3Config, WEIGHT_MAP)
