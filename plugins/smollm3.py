"""SmolLM3 (model_type `smollm3`), as a delta of Llama 3: every `no_rope_layer_interval`-th
layer (4) runs without rope (NoPE), or each layer as `no_rope_layers` says (1: rope, 0: none).
The checkpoint names are Llama's.
"""

from typing import ClassVar, Literal

from pydantic import PositiveInt

from core.errors import ConfigError
from core.hfconfig import DecoderConfig
from core.hookspecs import hookimpl
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP


class SmolLM3Config(DecoderConfig):
    """Defaults are transformers' SmolLM3Config's."""

    model_type: Literal["smollm3"] = "smollm3"
    tie_word_embeddings: bool = True
    # differs from llama3: NoPE layers
    no_rope_layers: list[Literal[0, 1]] | None = None
    no_rope_layer_interval: PositiveInt = 4
    # differs from llama3: optional sliding windows on the NoPE layers (off in the release)
    use_sliding_window: bool = False

    default_rope_theta: ClassVar[float] = 2000000.0

    def layer_ropes(self) -> list[bool]:
        n = self.num_hidden_layers
        if self.no_rope_layers is None:  # transformers: layer i is NoPE when (i + 1) % k == 0
            return [(i + 1) % self.no_rope_layer_interval != 0 for i in range(n)]
        if len(self.no_rope_layers) < n:
            raise ConfigError(
                f"config.json: field 'no_rope_layers' lists {len(self.no_rope_layers)} layers "
                f"for num_hidden_layers={n}; give a 1 (rope) or 0 (NoPE) per layer"
            )
        return [bool(x) for x in self.no_rope_layers[:n]]

    def default_layer_kinds(self) -> list[str]:
        slide = self.use_sliding_window and self.sliding_window is not None
        return [
            "sliding_attention" if slide and not roped else "full_attention"
            for roped in self.layer_ropes()
        ]

    def layer_windows(self) -> list[int | None]:
        if not self.use_sliding_window:  # transformers: no window unless switched on
            return [None] * self.num_hidden_layers
        return super().layer_windows()


# differs from llama3: nothing
WEIGHT_MAP = dict(LLAMA3_WEIGHT_MAP)


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture(("smollm3",), SmolLM3Config, WEIGHT_MAP)
