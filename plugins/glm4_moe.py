"""GLM-4.5 / 4.5-Air / 4.6 / 4.7 (model_type `glm4_moe`), as a delta of DeepSeek V3 (as
transformers builds it): the same MoE (dense first layers, shared experts, sigmoid `noaux_tc`
routing with a correction bias), but grouped-query attention with q/k/v biases, optional
per-head q/k RMSNorm, and rope on the first half of each head in Llama's half-split layout.
Its multi-token-prediction layers (`model.layers.{num_hidden_layers}.*`) are skipped at load.
"""

from dataclasses import replace
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, NonNegativeInt, PositiveFloat, PositiveInt

from core.config import GQASpec, RMSNormSpec
from core.hfconfig import DecoderConfig
from core.hookspecs import hookimpl
from plugins.deepseek import ROUTED_EXPERTS, DeepseekV3Config
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP


class Glm4MoeConfig(DeepseekV3Config):
    """Defaults are transformers' Glm4MoeConfig's; the MLA keys of DeepSeek are not read."""

    model_type: Literal["glm4_moe"] = "glm4_moe"
    rms_norm_eps: PositiveFloat = 1e-5
    max_position_embeddings: PositiveInt = 131072
    intermediate_size: PositiveInt = 10944  # the dense first layers' width
    # differs from deepseek_v3: GQA; q/k/v carry a bias when attention_bias, o_proj never
    use_qk_norm: bool = False  # per-head RMSNorm of q and k (GLM-4.5 / 4.6 / 4.7: true)
    partial_rotary_factor: Annotated[float, Field(gt=0, le=1)] = 0.5
    # differs from deepseek_v3: transformers' GLM defaults, and its routing is always sigmoid
    # noaux_tc (the hub's configs do not name it)
    n_routed_experts: PositiveInt | None = Field(
        128, validation_alias=AliasChoices("n_routed_experts", "num_local_experts")
    )
    n_shared_experts: NonNegativeInt | None = 1
    num_experts_per_tok: PositiveInt | None = 8
    moe_intermediate_size: PositiveInt = 1408
    first_k_dense_replace: NonNegativeInt = 1
    scoring_func: Literal["sigmoid"] = "sigmoid"
    topk_method: Literal["noaux_tc"] = "noaux_tc"
    n_group: PositiveInt | None = 1
    topk_group: PositiveInt | None = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: PositiveFloat = 1.0
    num_nextn_predict_layers: NonNegativeInt = Field(
        1, validation_alias=AliasChoices("num_nextn_predict_layers", "num_mtp_layers")
    )

    def rope_interleaved(self) -> bool:
        return False  # differs from deepseek_v3: (x_i, x_{i+d/2}) pairs, as Llama

    def rope_dim(self) -> int:
        # differs from deepseek_v3: int(head_dim * partial_rotary_factor) dims of each head
        return self.partial_rope_dim(self.partial_rotary_factor)

    def attention_spec(self) -> GQASpec:
        spec = DecoderConfig.attention_spec(self)  # differs from deepseek_v3: not MLA
        norm = RMSNormSpec(self.rms_norm_eps) if self.use_qk_norm else None
        return replace(spec, o_bias=False, qk_norm=norm)

    def routed_weights(self, top_k: int) -> tuple[bool, float]:
        # differs from deepseek_v3: renormalised even for top-1, as transformers' router does
        return self.norm_topk_prob, self.routed_scaling_factor


_L = "model.layers.{}"
WEIGHT_MAP = {
    # differs from deepseek: Llama's attention names (q/k/v fused); q_norm / k_norm identity
    **LLAMA3_WEIGHT_MAP,
    f"{_L}.mlp.shared_experts.gate_proj": (f"{_L}.mlp.shared_experts.gate_up_proj", "gate"),
    f"{_L}.mlp.shared_experts.up_proj": (f"{_L}.mlp.shared_experts.gate_up_proj", "up"),
    **ROUTED_EXPERTS,
    "mtp.*": None,  # a GGUF file's MTP blocks (plugins/formats/gguf.py names them so): not run
}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture(("glm4_moe",), Glm4MoeConfig, WEIGHT_MAP)
