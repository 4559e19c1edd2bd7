"""Mixtral 8x7B / 8x22B (model_type `mixtral`), as a delta of Mistral (its attention, with a
sliding window on every layer when `sliding_window` is set): every MLP is a mixture of experts,
softmax top-k routing renormalised over the chosen experts, no shared expert.

The MoE layer is the core's (`core/layers/moe.py`, the one DeepSeek uses); this file reads
config.json and maps Mixtral's `block_sparse_moe.experts.E.w1/w2/w3` onto the stacked experts.
"""

from typing import Literal

from pydantic import AliasChoices, Field, PositiveFloat, PositiveInt

from core.config import MoESpec
from core.hfconfig import every_layer_moe
from core.hookspecs import hookimpl
from plugins.deepseek import STACKED_EXPERTS
from plugins.mistral import WEIGHT_MAP as MISTRAL_WEIGHT_MAP
from plugins.mistral import MistralConfig


class MixtralConfig(MistralConfig):
    """Defaults are transformers' MixtralConfig's; hub configs spell every key out."""

    model_type: Literal["mixtral"] = "mixtral"
    rms_norm_eps: PositiveFloat = 1e-5
    max_position_embeddings: PositiveInt = 4096 * 32
    default_rope_theta = 1e6  # transformers' default when rope_theta is absent
    # differs from mistral: intermediate_size is each expert's width; every layer is MoE
    num_local_experts: PositiveInt = Field(
        8, validation_alias=AliasChoices("num_local_experts", "num_experts")
    )
    num_experts_per_tok: PositiveInt = 2

    def moe_spec(self) -> MoESpec:
        # softmax top-k renormalised, always, even for top-1 (the weight is then 1)
        return every_layer_moe(self, "num_local_experts", self.intermediate_size)


_L = "model.layers.{}"
WEIGHT_MAP = {
    **MISTRAL_WEIGHT_MAP,
    # differs from mistral: the hub's Mixtral checkpoints keep the MoE under block_sparse_moe,
    # one expert per w1 (gate), w3 (up), w2 (down)
    f"{_L}.block_sparse_moe.gate": f"{_L}.mlp.gate",
    f"{_L}.block_sparse_moe.experts.{{}}.w1": (f"{_L}.mlp.experts.gate_up_proj", "{}.gate"),
    f"{_L}.block_sparse_moe.experts.{{}}.w3": (f"{_L}.mlp.experts.gate_up_proj", "{}.up"),
    f"{_L}.block_sparse_moe.experts.{{}}.w2": (f"{_L}.mlp.experts.down_proj", "{}"),
    # transformers 5's own names: mlp.gate (identity) and the experts stacked
    **STACKED_EXPERTS,
}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture(("mixtral",), MixtralConfig, WEIGHT_MAP)
