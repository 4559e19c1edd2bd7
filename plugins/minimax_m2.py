"""MiniMax M2 / M2.1 / M2.5 (model_type `minimax_m2`), as a delta of Mixtral: every layer a
mixture of experts routed by sigmoid scores plus a correction bias (the core's noaux_tc over one
group), renormalised; rope on the first `rotary_dim` dims of each head (half-split, as
GLM-4.5's); q and k RMS-normed over all heads at once (`q_norm` holds num_heads * head_dim
weights), before the split into heads. Its multi-token-prediction modules are skipped at load.
"""

from dataclasses import replace
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, NonNegativeInt, PositiveFloat, PositiveInt

from core.config import GQASpec, MoESpec, RMSNormSpec
from core.errors import ConfigError
from core.hfconfig import DecoderConfig, routed_top_k
from core.hookspecs import hookimpl
from plugins.mixtral import WEIGHT_MAP as MIXTRAL_WEIGHT_MAP


class MiniMaxM2Config(DecoderConfig):
    """Defaults are transformers' MiniMaxM2Config's. The keys transformers does not read but
    MiniMax's own code does (use_qk_norm, qk_norm_type, scoring_func, use_routing_bias,
    shared_intermediate_size, attn_type_list) are checked to be what transformers computes."""

    model_type: Literal["minimax_m2"] = "minimax_m2"
    head_dim: PositiveInt | None = 128
    max_position_embeddings: PositiveInt = 196608
    default_rope_theta = 5e6  # transformers' default when rope_theta is absent
    # differs from mixtral: rope on rotary_dim dims of each head; a partial_rotary_factor
    # (top level or in the rope parameters) wins over it, as in transformers
    rotary_dim: PositiveInt | None = None
    partial_rotary_factor: Annotated[float, Field(gt=0, le=1)] | None = None
    # differs from mixtral: intermediate_size is each expert's width; sigmoid routing with a
    # correction bias, q/k norms over all heads, no shared expert, attention without biases
    num_local_experts: PositiveInt = Field(
        256, validation_alias=AliasChoices("num_local_experts", "num_experts")
    )
    num_experts_per_tok: PositiveInt = 8
    attention_bias: Literal[False] = False
    use_qk_norm: Literal[True] = True
    qk_norm_type: Literal["per_layer"] = "per_layer"
    scoring_func: Literal["sigmoid"] = "sigmoid"
    use_routing_bias: Literal[True] = True
    shared_intermediate_size: Literal[0] = 0
    attn_type_list: list[NonNegativeInt] | None = None  # 1: full attention (0: linear, M1's)
    # differs from mixtral: MTP modules stored after the decoder's layers, not run
    use_mtp: bool = False
    num_mtp_modules: NonNegativeInt = 0
    mtp_transformer_layers: PositiveInt = 1
    rms_norm_eps: PositiveFloat = 1e-6

    def rope_dim(self) -> int:
        head = self.resolved_head_dim()
        rotary = self.rotary_dim / head if self.rotary_dim is not None else None
        return self.partial_rope_dim(self.partial_rotary_factor or rotary)

    def attention_spec(self) -> GQASpec:
        linear = [i for i, kind in enumerate(self.attn_type_list or ()) if kind != 1]
        if linear:
            raise ConfigError(
                f"config.json: field 'attn_type_list' marks layers {linear} as linear attention "
                "(MiniMax-M1 / Text-01's lightning attention), which minimax_m2 does not run; "
                "every entry must be 1 (full attention)"
            )
        spec = super().attention_spec()
        return replace(spec, qk_norm=RMSNormSpec(self.rms_norm_eps), qk_norm_all_heads=True)

    def moe_spec(self) -> MoESpec:
        e = self.num_local_experts
        return MoESpec(
            num_experts=e,
            top_k=routed_top_k(self.num_experts_per_tok, e, "num_local_experts"),
            intermediate_size=self.intermediate_size,
            num_shared_experts=0,
            layers=tuple(range(self.num_hidden_layers)),
            scoring="sigmoid",
            topk_method="noaux_tc",  # one group: top-k of score + bias, weights unbiased
            norm_topk_prob=True,
        )

    def mtp_layers(self) -> int:
        return self.num_mtp_modules * self.mtp_transformer_layers if self.use_mtp else 0


_L = "model.layers.{}"
WEIGHT_MAP = {
    **MIXTRAL_WEIGHT_MAP,
    # differs from mixtral: the router's correction bias sits beside the gate, not in it
    f"{_L}.block_sparse_moe.e_score_correction_bias": f"{_L}.mlp.gate.e_score_correction_bias",
    f"{_L}.mlp.e_score_correction_bias": f"{_L}.mlp.gate.e_score_correction_bias",
}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture(("minimax_m2",), MiniMaxM2Config, WEIGHT_MAP)
