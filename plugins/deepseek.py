"""DeepSeek V2 / V2-Lite (model_type `deepseek_v2`) and V3 / R1 (`deepseek_v3`), as a delta of
Llama 3: multi-head latent attention (MLA), mixture-of-experts MLPs, YaRN rope in the
interleaved layout. The layers live in the core (`core/layers/mla.py`, `core/layers/moe.py`);
this file only reads config.json and maps the checkpoint names.
"""

from dataclasses import replace
from typing import Literal

from pydantic import NonNegativeInt, PositiveFloat, PositiveInt

from core.config import MLASpec, MoESpec, RopeSpec
from core.config_kinds import MTPSpec
from core.errors import ConfigError
from core.hfconfig import DecoderConfig
from core.hfrope import yarn_mscale
from core.hookspecs import hookimpl
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP


class DeepseekV2Config(DecoderConfig):
    """Defaults are transformers' DeepseekV2Config's; hub configs spell every key out."""

    model_type: Literal["deepseek_v2"] = "deepseek_v2"
    # differs from llama3: MLA; q through a low-rank pair unless q_lora_rank is null
    q_lora_rank: PositiveInt | None = 1536
    kv_lora_rank: PositiveInt = 512
    qk_nope_head_dim: PositiveInt = 128
    qk_rope_head_dim: PositiveInt = 64
    v_head_dim: PositiveInt = 128
    # differs from llama3: MoE MLPs from layer first_k_dense_replace on, every moe_layer_freq-th
    n_routed_experts: PositiveInt | None = 64  # null: every MLP is dense
    n_shared_experts: NonNegativeInt | None = 2
    num_experts_per_tok: PositiveInt | None = None
    moe_intermediate_size: PositiveInt = 1407
    first_k_dense_replace: NonNegativeInt = 0
    moe_layer_freq: PositiveInt = 1
    scoring_func: Literal["softmax", "sigmoid"] = "softmax"
    topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"] = "greedy"
    n_group: PositiveInt | None = None
    topk_group: PositiveInt | None = None
    norm_topk_prob: bool = False
    routed_scaling_factor: PositiveFloat = 1.0
    num_nextn_predict_layers: NonNegativeInt = 0  # MTP layers stored after the decoder's
    # quantization_config (DeepSeek's own V3/R1 weights are block fp8) is the format's to read:
    # plugins/formats/safetensors_fp8.py dequantizes them at load

    def rope_interleaved(self) -> bool:
        return True  # V2 rotates (x0, x1) pairs, as complex numbers

    # --- attention --------------------------------------------------------------------------
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim  # differs from llama3: rope on the qk_rope_head_dim part only

    def rope_spec(self) -> RopeSpec:
        return replace(super().rope_spec(), interleaved=self.rope_interleaved())

    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim) squared."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** (-0.5)
        kind, params = self.rope_params()
        if kind != "default" and params.get("mscale_all_dim"):
            mscale = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
            scale = scale * mscale * mscale
        return scale

    def attention_spec(self) -> MLASpec:
        if self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"config.json: field 'qk_rope_head_dim' ({self.qk_rope_head_dim}) must be even"
            )
        self.rope_spec()  # validate rope_scaling before softmax_scale reads its factor
        return MLASpec(
            num_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            scale=self.softmax_scale(),
            bias=self.attention_bias,
        )

    # --- MoE --------------------------------------------------------------------------------
    def routed_weights(self, top_k: int) -> tuple[bool, float]:
        """(norm_topk_prob, routed_scaling_factor) as the router applies them."""
        # V2's reference code scales only weights it did not renormalise
        norm = self.norm_topk_prob and top_k > 1
        return norm, 1.0 if norm else self.routed_scaling_factor

    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is the MoE: from first_k_dense_replace, every moe_layer_freq-th."""
        n, every = self.num_hidden_layers, self.moe_layer_freq
        return tuple(i for i in range(self.first_k_dense_replace, n) if i % every == 0)

    def moe_spec(self) -> MoESpec | None:
        layers = self.moe_layers()
        if self.n_routed_experts is None or not layers:
            return None
        e, k = self.n_routed_experts, self.num_experts_per_tok
        if k is None or k > e:
            raise ConfigError(
                f"config.json: field 'num_experts_per_tok' ({k}) must be set, between 1 and "
                f"n_routed_experts ({e})"
            )
        groups, topk_groups = self._groups(e, k)
        norm, scale = self.routed_weights(k)
        return MoESpec(
            num_experts=e,
            top_k=k,
            intermediate_size=self.moe_intermediate_size,
            num_shared_experts=self.n_shared_experts or 0,
            layers=layers,
            scoring=self.scoring_func,
            topk_method=self.topk_method,
            num_groups=groups,
            topk_groups=topk_groups,
            norm_topk_prob=norm,
            routed_scaling_factor=scale,
            shared_bias=self.mlp_bias,
        )

    def _groups(self, e: int, k: int) -> tuple[int, int]:
        if self.topk_method == "greedy":
            return 1, 1  # n_group / topk_group unused
        g, tg = self.n_group, self.topk_group
        if g is None or tg is None or e % g or tg > g:
            raise ConfigError(
                f"config.json: topk_method {self.topk_method!r} needs fields 'n_group' ({g}) "
                f"dividing n_routed_experts ({e}) and 'topk_group' ({tg}) <= n_group"
            )
        per_group = e // g
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ConfigError(
                f"config.json: topk_method 'noaux_tc' ranks groups by their top-2 experts, but "
                f"n_group ({g}) leaves {per_group} expert per group"
            )
        if k > tg * per_group:
            raise ConfigError(
                f"config.json: field 'num_experts_per_tok' ({k}) exceeds the experts in "
                f"topk_group ({tg}) groups of {per_group}"
            )
        return g, tg

    def mtp_layers(self) -> int:
        return self.num_nextn_predict_layers  # differs from llama3: skipped, unless speculating

    def mtp_spec(self) -> MTPSpec | None:
        """The MTP layer is built as a decoder layer at index num_hidden_layers would be: this
        attention, and the MoE where that index is an MoE layer (V3: from first_k_dense_replace
        on)."""
        if not self.num_nextn_predict_layers:
            return None
        n, moe = self.num_hidden_layers, self.moe_spec()
        routed = (
            moe is not None and n >= self.first_k_dense_replace and n % self.moe_layer_freq == 0
        )
        return MTPSpec(self.attention_spec(), moe if routed else self.mlp_spec())


class DeepseekV3Config(DeepseekV2Config):
    """Defaults are transformers' DeepseekV3Config's."""

    model_type: Literal["deepseek_v3"] = "deepseek_v3"
    n_routed_experts: PositiveInt | None = 256
    n_shared_experts: NonNegativeInt | None = 1
    num_experts_per_tok: PositiveInt | None = 8
    moe_intermediate_size: PositiveInt = 2048
    first_k_dense_replace: NonNegativeInt = 3
    # differs from v2: sigmoid scores, bias-corrected group-limited routing
    scoring_func: Literal["softmax", "sigmoid"] = "sigmoid"
    topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"] = "noaux_tc"
    n_group: PositiveInt | None = 8
    topk_group: PositiveInt | None = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: PositiveFloat = 2.5
    num_nextn_predict_layers: NonNegativeInt = 1
    rope_interleave: bool = True

    def rope_interleaved(self) -> bool:
        return self.rope_interleave

    def routed_weights(self, top_k: int) -> tuple[bool, float]:
        # differs from v2: the scaling factor applies after renormalising too
        return self.norm_topk_prob and top_k > 1, self.routed_scaling_factor


_L = "model.layers.{}"
# transformers 5 keeps routed experts stacked, as the core does: `mlp.experts.gate_up_proj`
# (E, 2I, H), gate rows then up rows, and `mlp.experts.down_proj` (E, H, I), with no `.weight`
# leaf; these whole-tensor keys fill the core's stacked parameters in one piece
STACKED_EXPERTS = {
    f"{_L}.mlp.experts.gate_up_proj": f"{_L}.mlp.experts.gate_up_proj.weight",
    f"{_L}.mlp.experts.down_proj": f"{_L}.mlp.experts.down_proj.weight",
}
# each routed expert stored on its own (the hub's checkpoints) fills its slice of them
ROUTED_EXPERTS = {
    f"{_L}.mlp.experts.{{}}.gate_proj": (f"{_L}.mlp.experts.gate_up_proj", "{}.gate"),
    f"{_L}.mlp.experts.{{}}.up_proj": (f"{_L}.mlp.experts.gate_up_proj", "{}.up"),
    f"{_L}.mlp.experts.{{}}.down_proj": (f"{_L}.mlp.experts.down_proj", "{}"),
    **STACKED_EXPERTS,
}
WEIGHT_MAP = {
    # differs from llama3: MLA keeps its projections unfused, under their hub names (identity)
    **{
        k: v for k, v in LLAMA3_WEIGHT_MAP.items() if not k.endswith(("q_proj", "k_proj", "v_proj"))
    },
    # differs from llama3: shared experts fuse gate/up like the dense MLP
    f"{_L}.mlp.shared_experts.gate_proj": (f"{_L}.mlp.shared_experts.gate_up_proj", "gate"),
    f"{_L}.mlp.shared_experts.up_proj": (f"{_L}.mlp.shared_experts.gate_up_proj", "up"),
    # differs from llama3: routed experts, per expert or stacked
    **ROUTED_EXPERTS,
}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture(("deepseek_v2",), DeepseekV2Config, WEIGHT_MAP)
    registry.add_architecture(("deepseek_v3",), DeepseekV3Config, WEIGHT_MAP)
