"""Qwen2 / Qwen2.5 and DeepSeek-R1-Distill-Qwen (model_type `qwen2`), as a delta of Llama 3.

The checkpoint names are Llama's, so the weight map is llama3's; the differences are in the
config: biases on q/k/v, and optional sliding windows on the layers from max_window_layers on.
"""

from dataclasses import replace
from typing import Literal

from pydantic import NonNegativeInt

from core.config import GQASpec
from core.hfconfig import DecoderConfig
from core.hookspecs import hookimpl
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP


class Qwen2Config(DecoderConfig):
    model_type: Literal["qwen2"] = "qwen2"
    # differs from llama3: a sliding window on layers >= max_window_layers (or on those
    # `layer_types` marks sliding_attention), only when use_sliding_window is true
    use_sliding_window: bool = False
    max_window_layers: NonNegativeInt = 28

    def attention_spec(self) -> GQASpec:
        spec = super().attention_spec()
        # differs from llama3: q/k/v always carry a bias, o never does (attention_bias unused)
        return replace(spec, qkv_bias=True, o_bias=False)

    def default_layer_kinds(self) -> list[str]:
        return [
            "sliding_attention"
            if self.use_sliding_window and i >= self.max_window_layers
            else "full_attention"
            for i in range(self.num_hidden_layers)
        ]

    def layer_windows(self) -> list[int | None]:
        # transformers drops sliding_window unless use_sliding_window (the released configs
        # carry a window with use_sliding_window false): then no layer slides, whatever
        # layer_types says
        if not self.use_sliding_window:
            return [None] * self.num_hidden_layers
        return super().layer_windows()


# differs from llama3: nothing; q/k/v biases fill the same fused shards as their weights
WEIGHT_MAP = dict(LLAMA3_WEIGHT_MAP)


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture(("qwen2",), Qwen2Config, WEIGHT_MAP)
