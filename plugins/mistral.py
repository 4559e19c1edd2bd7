"""Mistral 7B v0.1 / v0.2 / v0.3 and Ministral-style dense models (model_type `mistral`), as a
delta of Llama 3: the checkpoint names are Llama's; v0.1 slides a 4096-token window on every
layer (`sliding_window`), v0.2 and v0.3 set it to null.
"""

from typing import Literal

from core.hfconfig import DecoderConfig
from core.hookspecs import hookimpl
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP


class MistralConfig(DecoderConfig):
    model_type: Literal["mistral"] = "mistral"

    def layer_windows(self) -> list[int | None]:
        # differs from llama3: one window for every layer, when set (transformers' Mistral
        # ignores layer_types)
        return [self.sliding_window] * self.num_hidden_layers


# differs from llama3: nothing
WEIGHT_MAP = dict(LLAMA3_WEIGHT_MAP)


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture(("mistral",), MistralConfig, WEIGHT_MAP)
