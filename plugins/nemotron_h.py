"""Nemotron-H (`nemotron_h`: Nemotron-H 4B / 8B / 47B / 56B, Nemotron Nano 2, Nemotron 3 Nano).

Each layer is ONE mixer behind one RMSNorm, out = x + mixer(norm(x)), the mixer picked by the
layer's letter in `hybrid_override_pattern` (or its word in the newer `layers_block_type`):
"M" Mamba2, "*" attention, "-" MLP, "E" MoE. In the core's two-sub-block DecoderBlock a layer
is its mixer and a `NoSubBlock` in the other place, so the one norm is `input_layernorm`.

- attention: GQA without rope (NoPE) nor biases (transformers ignores `attention_bias`);
- MLP: not gated, down(relu2(up(x)));
- MoE (Nemotron 3 Nano): sigmoid scores, the noaux_tc choice with e_score_correction_bias
  within the n_group / topk_group groups, renormalised top-k times routed_scaling_factor,
  relu2 experts and one relu2 shared expert; `moe_latent_size` is refused;
- norms: RMSNorm with the weight applied in fp32 (`fp32_scale`).
Checkpoints keep the model under `backbone.` with `embeddings` / `norm_f`; multi-token
prediction weights (`mtp.*`) are not loaded.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import NonNegativeInt, PositiveFloat, PositiveInt

from core.config import DenseMLPSpec, GQASpec, MoESpec, RMSNormSpec, RuntimeConfig
from core.config_kinds import Mamba2Spec, NoSubBlock
from core.errors import ConfigError
from core.hfconfig import DecoderConfig
from core.hookspecs import hookimpl
from plugins.granite_hybrid import mamba2_names

LETTERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# layers_block_type's words, transformers 5's and the hub's older ones
WORDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
         "attention": "attention", "mlp": "mlp", "moe": "moe"}  # fmt: skip


class NemotronHConfig(DecoderConfig):
    """Defaults are transformers' NemotronHConfig's."""

    model_type: Literal["nemotron_h"] = "nemotron_h"
    vocab_size: PositiveInt = 131072
    hidden_size: PositiveInt = 4096
    num_hidden_layers: PositiveInt | None = None  # the pattern's length decides
    hybrid_override_pattern: str | None = None
    layers_block_type: list[str] | None = None
    num_attention_heads: PositiveInt = 32
    num_key_value_heads: PositiveInt | None = 8
    head_dim: PositiveInt | None = None
    attention_head_dim: PositiveInt | None = None  # the first hub configs' name of head_dim
    intermediate_size: PositiveInt = 21504
    mlp_hidden_act: Literal["relu2"] = "relu2"
    hidden_act: str | None = None  # some hub configs repeat mlp_hidden_act here; unused
    layer_norm_epsilon: PositiveFloat = 1e-5
    max_position_embeddings: PositiveInt = 4096
    # Mamba2
    ssm_state_size: PositiveInt = 128
    mamba_num_heads: PositiveInt = 128
    mamba_head_dim: PositiveInt = 64
    mamba_hidden_act: Literal["silu"] = "silu"
    n_groups: PositiveInt = 8
    conv_kernel: PositiveInt = 4
    use_conv_bias: bool = True
    use_bias: bool = False  # in_proj and out_proj
    chunk_size: PositiveInt = 128
    time_step_min: PositiveFloat = 0.001  # transformers clamps dt from below by it
    # MoE
    n_routed_experts: PositiveInt = 8
    num_experts_per_tok: PositiveInt = 2
    moe_intermediate_size: PositiveInt = 7688
    moe_shared_expert_intermediate_size: PositiveInt = 7688
    moe_latent_size: PositiveInt | None = None
    n_group: PositiveInt = 1
    topk_group: PositiveInt = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: PositiveFloat = 1.0
    num_nextn_predict_layers: NonNegativeInt = 0

    @classmethod
    def from_dict(cls, raw: Any, source: str = "config.json") -> NemotronHConfig:
        if isinstance(raw, dict):  # the older hub keys of the Mamba fields (transformers')
            old = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel",
                   "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size",
                   "mamba_dt_min": "time_step_min"}  # fmt: skip
            raw = {old.get(k, k): v for k, v in raw.items() if not (k in old and old[k] in raw)}
            raw.setdefault("num_hidden_layers", len(_kinds_of(raw)) or None)
        return super().from_dict(raw, source)

    def layer_kinds(self) -> list[str]:
        """mamba | attention | mlp | moe per layer, from `layers_block_type` or the pattern."""
        kinds = _kinds_of(self.model_dump())
        if not kinds:
            raise ConfigError(
                "config.json: set field 'hybrid_override_pattern' (one of M * - E per layer) "
                "or 'layers_block_type'"
            )
        if self.num_hidden_layers is not None and len(kinds) != self.num_hidden_layers:
            raise ConfigError(
                f"config.json: field 'hybrid_override_pattern' gives {len(kinds)} layers but "
                f"num_hidden_layers is {self.num_hidden_layers}; give one letter per layer"
            )
        return kinds

    def resolved_head_dim(self) -> int:
        return self.head_dim or self.attention_head_dim or 128  # transformers' default: 128

    def norm_spec(self) -> RMSNormSpec:
        return RMSNormSpec(self.layer_norm_epsilon, fp32_scale=True)  # weight * x in fp32

    def attention_spec(self) -> GQASpec:
        # differs from llama3: no rope, and no biases whatever attention_bias says
        spec = super().attention_spec()
        return GQASpec(spec.num_heads, spec.num_kv_heads, spec.head_dim, rope="none")

    def mamba_spec(self) -> Mamba2Spec:
        if self.mamba_num_heads % self.n_groups:
            raise ConfigError(
                f"config.json: mamba_num_heads ({self.mamba_num_heads}) must be a multiple of "
                f"n_groups ({self.n_groups})"
            )
        if self.conv_kernel < 2:
            raise ConfigError("config.json: field 'conv_kernel' must be at least 2")
        return Mamba2Spec(
            num_heads=self.mamba_num_heads,
            head_dim=self.mamba_head_dim,
            state_size=self.ssm_state_size,
            n_groups=self.n_groups,
            conv_kernel=self.conv_kernel,
            chunk_size=self.chunk_size,
            norm_eps=self.layer_norm_epsilon,
            conv_bias=self.use_conv_bias,
            bias=self.use_bias,
            # transformers' mixer: (time_step_min, inf), whatever time_step_limit says
            time_step_limit=(self.time_step_min, float("inf")),
        )

    def attention_layers(self, base: Any) -> tuple[Any, ...]:
        kinds = self.layer_kinds()
        mamba = self.mamba_spec() if "mamba" in kinds else None
        pick = {"mamba": mamba, "attention": base}
        return tuple(pick.get(k, NoSubBlock()) for k in kinds)

    def mlp_spec(self) -> DenseMLPSpec:
        return DenseMLPSpec(self.intermediate_size, bias=self.mlp_bias, act="relu2", gated=False)

    def moe_spec(self) -> MoESpec | None:
        layers = tuple(i for i, k in enumerate(self.layer_kinds()) if k == "moe")
        if not layers:
            return None
        e, k = self.n_routed_experts, self.num_experts_per_tok
        if self.moe_latent_size is not None:
            raise ConfigError(
                "config.json: field 'moe_latent_size' (experts in a latent space, Nemotron 3 "
                "Super) is not supported yet; only null"
            )
        if k > e or e % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(
                f"config.json: fields 'num_experts_per_tok' ({k}), 'n_group' ({self.n_group}) "
                f"and 'topk_group' ({self.topk_group}) must fit n_routed_experts ({e}): "
                "k <= experts, experts divisible by n_group, topk_group <= n_group"
            )
        return MoESpec(
            num_experts=e,
            top_k=k,
            intermediate_size=self.moe_intermediate_size,
            num_shared_experts=0,
            shared_intermediate_size=self.moe_shared_expert_intermediate_size,
            layers=layers,
            scoring="sigmoid",
            topk_method="noaux_tc",
            num_groups=self.n_group,
            topk_groups=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
            shared_bias=self.mlp_bias,
            act="relu2",
            gated=False,
            router_fp32=True,  # transformers' _keep_in_fp32_modules_strict: gate.weight
        )

    def to_runtime(self) -> RuntimeConfig:
        cfg = super().to_runtime()
        # the MLP place: the dense MLP on "-" layers (MoE ones: cfg.moe), nothing elsewhere
        mlps = tuple(cfg.mlp if k in ("mlp", "moe") else NoSubBlock() for k in self.layer_kinds())
        return replace(cfg, mlp_layers=mlps)


def _kinds_of(raw: dict[str, Any]) -> list[str]:
    """The layer kinds a raw config names ([] if none); unknown letters or words refused."""
    words, pattern = raw.get("layers_block_type"), raw.get("hybrid_override_pattern")
    if words is not None:
        bad = sorted({w for w in words if w not in WORDS})
        if bad:
            raise ConfigError(
                f"config.json: field 'layers_block_type' holds {bad}; each must be one of "
                f"{', '.join(WORDS)}"
            )
        return [WORDS[w] for w in words]
    if pattern is None:
        return []
    bad = sorted(set(pattern) - set(LETTERS))
    if bad:
        raise ConfigError(
            f"config.json: field 'hybrid_override_pattern' holds {bad}; each letter must be "
            "M (Mamba2), * (attention), - (MLP) or E (MoE)"
        )
    return [LETTERS[c] for c in pattern]


_L = "model.layers.{}"
_MIXER = f"{_L}.mixer"
WEIGHT_MAP = {
    "backbone.*": "model.*",  # then, under model.:
    "model.embeddings": "model.embed_tokens",
    "model.norm_f": "model.norm",
    f"{_L}.norm": f"{_L}.input_layernorm",  # the layer's one norm
    # attention
    **{f"{_MIXER}.{p}_proj": (f"{_L}.self_attn.qkv_proj", p) for p in "qkv"},
    f"{_MIXER}.o_proj": f"{_L}.self_attn.o_proj",
    # MLP and MoE
    f"{_MIXER}.up_proj": f"{_L}.mlp.up_proj",
    f"{_MIXER}.down_proj": f"{_L}.mlp.down_proj",
    f"{_MIXER}.gate": f"{_L}.mlp.gate",
    f"{_MIXER}.experts.{{}}.up_proj": (f"{_L}.mlp.experts.up_proj", "{}"),
    f"{_MIXER}.experts.{{}}.down_proj": (f"{_L}.mlp.experts.down_proj", "{}"),
    # transformers 5's in-memory names: each stack whole, (experts, out, in) as the core's
    f"{_MIXER}.experts.up_proj": f"{_L}.mlp.experts.up_proj.weight",
    f"{_MIXER}.experts.down_proj": f"{_L}.mlp.experts.down_proj.weight",
    f"{_MIXER}.shared_experts.up_proj": f"{_L}.mlp.shared_experts.up_proj",
    f"{_MIXER}.shared_experts.down_proj": f"{_L}.mlp.shared_experts.down_proj",
    # Mamba2: the mixer runs as the block's self_attn (A_log, D, dt_bias directly under it)
    **mamba2_names(_MIXER, f"{_L}.self_attn"),
    "mtp.*": None,  # multi-token prediction: not run
}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture("nemotron_h", NemotronHConfig, WEIGHT_MAP)
