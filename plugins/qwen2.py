"""Qwen2 / Qwen2.5 and DeepSeek-R1-Distill-Qwen (model_type `qwen2`), as a delta of Llama 3.

The checkpoint names are Llama's, so the weight map is llama3's; the differences are in the
config: biases on q/k/v, and the sliding-window keys, which Zoo refuses rather than ignores.
"""

from dataclasses import replace
from typing import Literal

from pydantic import NonNegativeInt, PositiveInt

from core.config import GQASpec
from core.errors import ConfigError
from core.hfconfig import DecoderConfig
from core.hookspecs import hookimpl
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP


class Qwen2Config(DecoderConfig):
    model_type: Literal["qwen2"] = "qwen2"
    # differs from llama3: optional sliding-window attention on layers >= max_window_layers
    use_sliding_window: bool = False
    sliding_window: PositiveInt | None = None
    max_window_layers: NonNegativeInt = 28
    layer_types: list[str] | None = None  # transformers 5 writes these out per layer

    def attention_spec(self) -> GQASpec:
        spec = super().attention_spec()
        # differs from llama3: q/k/v always carry a bias, o never does (attention_bias unused)
        return replace(spec, qkv_bias=True, o_bias=False)

    def sliding_layers(self) -> list[int]:
        """The layers transformers would run with a sliding window (none unless enabled)."""
        if not self.use_sliding_window or self.sliding_window is None:
            return []
        n = self.num_hidden_layers
        kinds = self.layer_types or [
            "sliding_attention" if i >= self.max_window_layers else "full_attention"
            for i in range(n)
        ]
        return [i for i, kind in enumerate(kinds[:n]) if kind == "sliding_attention"]

    def to_runtime(self):
        # differs from llama3: sliding-window attention is not implemented, so refuse it loudly
        sliding = self.sliding_layers()
        if sliding:
            raise ConfigError(
                f"config.json: field 'use_sliding_window' is true, so layers {sliding} would "
                f"attend within a window of sliding_window={self.sliding_window} tokens "
                f"(max_window_layers={self.max_window_layers}); Zoo does not implement "
                "sliding-window attention. Set use_sliding_window to false, as the released "
                "Qwen2 / Qwen2.5 configs do."
            )
        return super().to_runtime()


# differs from llama3: nothing; q/k/v biases fill the same fused shards as their weights
WEIGHT_MAP = dict(LLAMA3_WEIGHT_MAP)


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture(("qwen2",), Qwen2Config, WEIGHT_MAP)
