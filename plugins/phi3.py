"""Phi-3 / Phi-3.5 / Phi-4-mini (model_type `phi3`), as a delta of Mistral: one sliding window
on every layer when set (Phi-3-mini-4k: 2047), LongRoPE for the 128k models (short and long
factors, `original_max_position_embeddings`), rope on part of each head (Phi-4-mini: 0.75).
The checkpoint stores q|k|v as one `qkv_proj` and gate|up as one `gate_up_proj`, exactly as the
core keeps them, so the weight map is empty.
"""

from typing import Annotated, Any, Literal

from pydantic import Field, PositiveInt

from core.errors import ConfigError
from core.hookspecs import hookimpl
from plugins.mistral import MistralConfig

ROPE_KINDS = ("default", "longrope")  # what transformers' Phi3Config accepts
OLD_LONGROPE = ("su", "yarn")  # early Phi-3 configs' names for longrope (transformers maps them)


class Phi3Config(MistralConfig):
    """Defaults are transformers' Phi3Config's."""

    model_type: Literal["phi3"] = "phi3"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: PositiveInt = 4096
    # differs from mistral: LongRoPE's pretraining length; wins over the one in rope_scaling,
    # as in transformers
    original_max_position_embeddings: PositiveInt = 4096
    # differs from mistral: rope turns only the first part of each head
    partial_rotary_factor: Annotated[float, Field(gt=0, le=1)] | None = None

    def layer_windows(self) -> list[int | None]:
        # differs from mistral: the 128k configs carry windows of 131072 or 262144, which never
        # mask a key within max_position_embeddings; they run as full attention (exact up to
        # that length) instead of a ring buffer as long as the cache
        if self.sliding_window is not None and self.sliding_window >= self.max_position_embeddings:
            return [None] * self.num_hidden_layers
        return super().layer_windows()

    def rope_params(self) -> tuple[str, dict[str, Any]]:
        kind, params = super().rope_params()
        kind = "longrope" if kind in OLD_LONGROPE else kind
        if kind not in ROPE_KINDS:
            where = "rope_parameters" if self.rope_parameters else "rope_scaling"
            raise ConfigError(
                f"config.json: field '{where}.type' is {kind!r}, which is not a Phi-3 rope "
                f"kind; Phi-3 uses {' or '.join(ROPE_KINDS)}"
            )
        return kind, params

    def rope_dim(self) -> int:
        # differs from mistral: int(head_dim * partial_rotary_factor) dims, as transformers
        return self.partial_rope_dim(self.partial_rotary_factor)


# differs from mistral: every tensor name maps to itself (fused q|k|v and gate|up)
WEIGHT_MAP: dict[str, Any] = {}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture(("phi3",), Phi3Config, WEIGHT_MAP)
