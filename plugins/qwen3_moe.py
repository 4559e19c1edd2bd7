"""Qwen3-MoE (model_type `qwen3_moe`: Qwen3-30B-A3B, Qwen3-235B-A22B), as a delta of Qwen3:
its attention (per-head q/k RMSNorm, explicit head_dim) with mixture-of-experts MLPs, softmax
top-k routing, no shared expert.

The MoE layer is the core's (`core/layers/moe.py`); this file reads config.json and maps
the experts, stored one by one (`mlp.experts.E.gate_proj.weight`, the hub's checkpoints) or
stacked (`mlp.experts.gate_up_proj`, transformers 5's names).
"""

from typing import Literal

from pydantic import AliasChoices, Field, NonNegativeInt, PositiveInt

from core.config import MoESpec
from core.errors import ConfigError
from core.hfconfig import routed_top_k
from core.hookspecs import hookimpl
from plugins.deepseek import ROUTED_EXPERTS
from plugins.qwen3 import WEIGHT_MAP as QWEN3_WEIGHT_MAP
from plugins.qwen3 import Qwen3Config


class Qwen3MoeConfig(Qwen3Config):
    """Defaults are transformers' Qwen3MoeConfig's; hub configs spell every key out."""

    model_type: Literal["qwen3_moe"] = "qwen3_moe"
    head_dim: PositiveInt | None = None  # differs from qwen3: absent means hidden / heads
    # differs from qwen3: routed experts on layer i unless i is in mlp_only_layers, when
    # (i + 1) % decoder_sparse_step == 0; the others are dense (intermediate_size)
    num_experts: NonNegativeInt = Field(  # transformers 5 writes num_local_experts
        128, validation_alias=AliasChoices("num_experts", "num_local_experts")
    )
    num_experts_per_tok: PositiveInt = 8
    moe_intermediate_size: PositiveInt = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: PositiveInt = 1
    mlp_only_layers: list[NonNegativeInt] | None = None

    def layer_windows(self) -> list[int | None]:
        # differs from qwen3: use_sliding_window slides every layer (transformers' Qwen3-MoE
        # reads neither max_window_layers nor layer_types)
        window = self.sliding_window if self.use_sliding_window else None
        return [window] * self.num_hidden_layers

    def moe_layers(self) -> tuple[int, ...]:
        n, dense = self.num_hidden_layers, set(self.mlp_only_layers or ())
        outside = sorted(i for i in dense if i >= n)
        if outside:
            raise ConfigError(
                f"config.json: field 'mlp_only_layers' names layers {outside}, but the model "
                f"has num_hidden_layers={n} (layers 0..{n - 1}); remove them"
            )
        step = self.decoder_sparse_step
        return tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)

    def moe_spec(self) -> MoESpec | None:
        layers = self.moe_layers()
        e, k = self.num_experts, self.num_experts_per_tok
        if e == 0 or not layers:
            return None  # every MLP dense, as transformers builds it
        return MoESpec(
            num_experts=e,
            top_k=routed_top_k(k, e, "num_experts"),
            intermediate_size=self.moe_intermediate_size,
            num_shared_experts=0,
            layers=layers,
            scoring="softmax",
            topk_method="greedy",
            norm_topk_prob=self.norm_topk_prob,
        )


# differs from qwen3: routed experts, one by one or stacked; the router (mlp.gate) is identity
WEIGHT_MAP = {**QWEN3_WEIGHT_MAP, **ROUTED_EXPERTS}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture(("qwen3_moe",), Qwen3MoeConfig, WEIGHT_MAP)
