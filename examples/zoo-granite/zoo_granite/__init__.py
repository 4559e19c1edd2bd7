"""Phi-3 / Phi-3.5 / Phi-4-mini (model_type `phi3`) for Zoo, as a delta of Llama 3.

Everything Phi-3 runs is a layer the core already has (GQA, SwiGLU, RMSNorm, rope), so this
plugin is a config adapter and a weight map; Zoo finds it through the `zoo.plugins` entry point
in pyproject.toml. Importing it imports no torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PositiveInt

from core.errors import ConfigError
from core.hfconfig import DecoderConfig
from core.hookspecs import hookimpl

__version__ = "0.1.0"

# Phi-3's names for its one long-context rope kind; transformers reads all three as longrope
LONGROPE = ("longrope", "su", "yarn")


class Phi3Config(DecoderConfig):
    """Defaults are transformers' Phi3Config's."""

    model_type: Literal["phi3"] = "phi3"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: PositiveInt = 4096
    # differs from llama3: rope may turn only the first part of each head (Phi-4-mini: 0.75)
    partial_rotary_factor: Annotated[float, Field(gt=0, le=1)] | None = None
    # differs from llama3: a sliding window, in every layer, when set
    sliding_window: PositiveInt | None = None

    def rope_spec(self):
        kind, _ = self.rope_params()
        if kind in LONGROPE:
            raise ConfigError(
                f"config.json: rope_scaling type {kind!r} (Phi-3's longrope, used by the 128k, "
                "Phi-3.5 and Phi-4-mini checkpoints) is not supported by zoo-phi3, which runs "
                "the default rope only"
            )
        if kind != "default":  # transformers' Phi3Config accepts nothing else either
            raise ConfigError(
                f"config.json: rope_scaling type {kind!r} is not a Phi-3 rope kind; "
                "Phi-3 uses the default rope or longrope"
            )
        return super().rope_spec()

    def rotary_factor(self) -> float:
        """partial_rotary_factor from the rope parameters (transformers 5) or the top level."""
        _, params = super().rope_params()
        return float(params.get("partial_rotary_factor") or self.partial_rotary_factor or 1.0)

    def rope_dim(self) -> int:
        # differs from llama3: int(head_dim * partial_rotary_factor) dims, as transformers
        dim = int(self.resolved_head_dim() * self.rotary_factor())
        if dim < 2 or dim % 2:
            raise ConfigError(
                f"config.json: field 'partial_rotary_factor' ({self.rotary_factor()}) gives "
                f"{dim} rotary dims per head (head_dim {self.resolved_head_dim()}); it needs an "
                "even number of at least 2"
            )
        return dim

    def to_runtime(self):
        # differs from llama3: sliding-window attention is not implemented; refuse a window
        # that would slide within the model's context rather than ignore it
        window = self.sliding_window
        if window is not None and window < self.max_position_embeddings:
            raise ConfigError(
                f"config.json: field 'sliding_window' is {window}, so attention would slide for "
                f"sequences longer than {window} tokens (max_position_embeddings="
                f"{self.max_position_embeddings}); Zoo does not implement sliding-window "
                f"attention. Set max_position_embeddings to at most {window} (the model is then "
                "exact), or use a checkpoint without a window."
            )
        return super().to_runtime()


# differs from llama3: the checkpoint stores q|k|v as one `qkv_proj` and gate|up as one
# `gate_up_proj`, exactly as the core keeps them (a fused parameter may be stored whole), so
# every tensor name maps to itself.
WEIGHT_MAP: dict[str, Any] = {}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture("phi3", Phi3Config, WEIGHT_MAP)
