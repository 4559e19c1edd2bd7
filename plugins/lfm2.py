"""Liquid LFM2 (`lfm2`; `lfm2_moe`: with routed experts): gated short-conv layers (`conv`:
core/layers/shortconv.py) mixed with grouped-query attention layers (`full_attention`), as a
delta of Llama.

Differs from Llama: attention RMS-norms q and k per head (q_layernorm / k_layernorm) and
projects out through out_proj; the norms are operator_norm / ffn_norm per block and the final
one is called `embedding_norm`; the SwiGLU MLP is w1 / w3 / w2 and its width is derived from
the configured one (`block_auto_adjust_ff_dim`: 2/3 of it, times block_ffn_dim_multiplier,
rounded up to block_multiple_of). Config keys as the hub carries them: `layer_types`, or the
legacy `full_attn_idxs` (absent both: every layer attends); `block_ff_dim` and `tie_embedding`
win over intermediate_size and tie_word_embeddings where present (as in transformers);
`norm_eps` is every norm's epsilon (the legacy `block_norm_eps` is not read, as transformers
does not).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import NonNegativeInt, PositiveFloat, PositiveInt

from core.config import DenseMLPSpec, GQASpec, MoESpec, RMSNormSpec
from core.config_kinds import ShortConvSpec
from core.errors import ConfigError
from core.hfconfig import DecoderConfig, routed_top_k
from core.hookspecs import hookimpl

KINDS = ("conv", "full_attention")


class Lfm2Config(DecoderConfig):
    """Defaults are transformers' Lfm2Config's."""

    model_type: Literal["lfm2"] = "lfm2"
    vocab_size: PositiveInt = 65536
    hidden_size: PositiveInt = 2560
    intermediate_size: PositiveInt = 12288
    num_hidden_layers: PositiveInt = 32
    num_attention_heads: PositiveInt = 32
    num_key_value_heads: PositiveInt | None = 8
    max_position_embeddings: PositiveInt = 128_000
    norm_eps: PositiveFloat = 1e-5
    tie_word_embeddings: bool = True
    conv_bias: bool = False
    conv_L_cache: PositiveInt = 3  # the hub's spelling
    block_multiple_of: PositiveInt = 256
    block_ffn_dim_multiplier: PositiveFloat | None = 1.0
    block_auto_adjust_ff_dim: bool = True
    full_attn_idxs: list[int] | None = None
    # legacy keys, winning over the new ones where present
    block_ff_dim: PositiveInt | None = None
    tie_embedding: bool | None = None
    default_rope_theta = 1_000_000.0
    layer_kind_names = KINDS

    def default_layer_kinds(self) -> list[str]:
        """Without `layer_types`: the legacy `full_attn_idxs` attend (absent: every layer)."""
        n = self.num_hidden_layers
        full = set(range(n) if self.full_attn_idxs is None else self.full_attn_idxs)
        return ["full_attention" if i in full else "conv" for i in range(n)]

    def norm_spec(self) -> RMSNormSpec:
        return RMSNormSpec(self.norm_eps)  # differs: `norm_eps`, not rms_norm_eps

    def attention_spec(self) -> GQASpec:
        return replace(super().attention_spec(), qk_norm=self.norm_spec())  # differs: q/k norm

    def conv_spec(self) -> ShortConvSpec:
        if self.conv_L_cache < 2:
            raise ConfigError("config.json: field 'conv_L_cache' must be at least 2")
        return ShortConvSpec(
            hidden=self.hidden_size, l_cache=self.conv_L_cache, bias=self.conv_bias
        )

    def attention_layers(self, base: Any) -> tuple[Any, ...]:
        conv = self.conv_spec()
        return tuple(conv if k == "conv" else base for k in self.layer_kinds())

    def ff_dim(self) -> int:
        """The MLP width as transformers' Lfm2MLP derives it."""
        width = self.block_ff_dim if self.block_ff_dim is not None else self.intermediate_size
        if not self.block_auto_adjust_ff_dim:
            return width
        width = int(2 * width / 3)
        if self.block_ffn_dim_multiplier is None:
            return width
        width = int(self.block_ffn_dim_multiplier * width)
        m = self.block_multiple_of
        return m * ((width + m - 1) // m)

    def mlp_spec(self) -> DenseMLPSpec:
        return DenseMLPSpec(self.ff_dim())

    def to_runtime(self):
        cfg = super().to_runtime()
        tied = self.tie_embedding if self.tie_embedding is not None else self.tie_word_embeddings
        return replace(cfg, tie_word_embeddings=tied)


class Lfm2MoeConfig(Lfm2Config):
    """LFM2-MoE (`lfm2_moe`, LFM2-8B-A1B): LFM2 whose MLPs after the first `num_dense_layers`
    are routed experts: sigmoid scores, the top `num_experts_per_tok` chosen by score plus
    `expert_bias` (`use_expert_bias`; else by score), weights the unbiased scores, renormalised
    (`norm_topk_prob`) and scaled. Defaults are transformers' Lfm2MoeConfig's."""

    model_type: Literal["lfm2_moe"] = "lfm2_moe"
    hidden_size: PositiveInt = 2048
    intermediate_size: PositiveInt = 7168
    moe_intermediate_size: PositiveInt = 1792
    num_dense_layers: NonNegativeInt = 2
    num_experts: PositiveInt = 32
    num_experts_per_tok: PositiveInt = 4
    use_expert_bias: bool = True
    routed_scaling_factor: PositiveFloat = 1.0
    norm_topk_prob: bool = True

    def ff_dim(self) -> int:
        return self.intermediate_size  # differs from lfm2: the dense layers' width as given

    def moe_spec(self) -> MoESpec:
        e = self.num_experts
        return MoESpec(
            num_experts=e,
            top_k=routed_top_k(self.num_experts_per_tok, e, "num_experts"),
            intermediate_size=self.moe_intermediate_size,
            num_shared_experts=0,
            layers=tuple(range(self.num_dense_layers, self.num_hidden_layers)),
            scoring="sigmoid",
            # the bias only ranks the experts (DeepSeek V3's noaux_tc, in one group)
            topk_method="noaux_tc" if self.use_expert_bias else "greedy",
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )


_L = "model.layers.{}"
WEIGHT_MAP = {
    "model.embedding_norm": "model.norm",
    f"{_L}.operator_norm": f"{_L}.input_layernorm",
    f"{_L}.ffn_norm": f"{_L}.post_attention_layernorm",
    f"{_L}.self_attn.q_proj": (f"{_L}.self_attn.qkv_proj", "q"),
    f"{_L}.self_attn.k_proj": (f"{_L}.self_attn.qkv_proj", "k"),
    f"{_L}.self_attn.v_proj": (f"{_L}.self_attn.qkv_proj", "v"),
    f"{_L}.self_attn.out_proj": f"{_L}.self_attn.o_proj",
    f"{_L}.self_attn.q_layernorm": f"{_L}.self_attn.q_norm",
    f"{_L}.self_attn.k_layernorm": f"{_L}.self_attn.k_norm",
    # the conv layer runs as the block's self_attn
    f"{_L}.conv.in_proj": f"{_L}.self_attn.in_proj",
    f"{_L}.conv.conv": f"{_L}.self_attn.conv",
    f"{_L}.conv.out_proj": f"{_L}.self_attn.out_proj",
    f"{_L}.feed_forward.w1": (f"{_L}.mlp.gate_up_proj", "gate"),
    f"{_L}.feed_forward.w3": (f"{_L}.mlp.gate_up_proj", "up"),
    f"{_L}.feed_forward.w2": f"{_L}.mlp.down_proj",
}

_EXPERTS = f"{_L}.feed_forward.experts"
LFM2_MOE_WEIGHT_MAP = {
    **WEIGHT_MAP,
    f"{_L}.feed_forward.gate": f"{_L}.mlp.gate",
    f"{_L}.feed_forward.expert_bias": f"{_L}.mlp.gate.e_score_correction_bias",  # whole name
    # routed experts, per expert (the hub's) or stacked (transformers 5's)
    f"{_EXPERTS}.{{}}.w1": (f"{_L}.mlp.experts.gate_up_proj", "{}.gate"),
    f"{_EXPERTS}.{{}}.w3": (f"{_L}.mlp.experts.gate_up_proj", "{}.up"),
    f"{_EXPERTS}.{{}}.w2": (f"{_L}.mlp.experts.down_proj", "{}"),
    f"{_EXPERTS}.gate_up_proj": f"{_L}.mlp.experts.gate_up_proj.weight",
    f"{_EXPERTS}.down_proj": f"{_L}.mlp.experts.down_proj.weight",
}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture("lfm2", Lfm2Config, WEIGHT_MAP)
    registry.add_architecture("lfm2_moe", Lfm2MoeConfig, LFM2_MOE_WEIGHT_MAP)
