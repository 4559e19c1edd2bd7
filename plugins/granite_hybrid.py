"""IBM Granite 4.0-H (model_type `granitemoehybrid`): Mamba2 layers (core/layers/mamba2.py)
mixed with attention layers, as a delta of Llama 3.

Each layer is a Mamba2 mixer (`layer_types` "mamba") or GQA attention ("attention"), without
rope unless `position_embedding_type` is "rope" (Granite 4.0-H ships NoPE). Every layer's MLP
is a shared SwiGLU (`shared_mlp`) plus, with `num_local_experts` > 0, routed experts
(`block_sparse_moe`: softmax over the top-k router logits); without experts (Granite 4.0-H-Micro)
the shared MLP is the whole MLP. Granite's four multipliers: embeddings times
`embedding_multiplier`, each sub-block's output times `residual_multiplier` before its residual
add, the attention scores times `attention_multiplier` (the softmax scale) and the logits
divided by `logits_scaling`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import NonNegativeInt, PositiveFloat, PositiveInt, field_validator

from core.config import DenseMLPSpec, EmbeddingSpec, GQASpec, MoESpec, RuntimeConfig
from core.config_kinds import Mamba2Spec
from core.errors import ConfigError
from core.hfconfig import DecoderConfig, every_layer_moe, json_floats
from core.hookspecs import hookimpl
from plugins.deepseek import ROUTED_EXPERTS
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP

MAMBA, ATTENTION = ("mamba", "linear_attention"), ("attention", "full_attention")


def mamba2_spec(
    cfg: Any, width: int, what: str = "mamba_expand x hidden_size", **more
) -> Mamba2Spec:
    """The `Mamba2Spec` of a config with Granite's mamba_* keys, for an inner width of `width`
    (`what`: its keys, named in errors) and the `more` fields a family adds; the head width
    (`mamba_d_head`, "auto": width / mamba_n_heads) and the sizes checked, each error naming
    its field."""
    heads, groups = cfg.mamba_n_heads, cfg.mamba_n_groups
    head_dim = width // heads if cfg.mamba_d_head == "auto" else cfg.mamba_d_head
    if head_dim * heads != width:
        raise ConfigError(
            f"config.json: mamba_n_heads ({heads}) x mamba_d_head ({cfg.mamba_d_head}) must "
            f"be {what} ({width})"
        )
    if heads % groups:
        raise ConfigError(
            f"config.json: mamba_n_heads ({heads}) is not a multiple of mamba_n_groups ({groups})"
        )
    if cfg.mamba_d_conv < 2:
        raise ConfigError("config.json: field 'mamba_d_conv' must be at least 2")
    return Mamba2Spec(
        num_heads=heads,
        head_dim=head_dim,
        state_size=cfg.mamba_d_state,
        n_groups=groups,
        conv_kernel=cfg.mamba_d_conv,
        chunk_size=cfg.mamba_chunk_size,
        norm_eps=cfg.rms_norm_eps,
        conv_bias=cfg.mamba_conv_bias,
        bias=cfg.mamba_proj_bias,
        time_step_limit=tuple(cfg.time_step_limit or (0.0, float("inf"))),
        **more,
    )


def mamba2_names(hub: str, core: str) -> dict[str, str]:
    """Weight-map entries for a Mamba2 mixer stored under `hub` and run as the module at `core`
    (hub names kept: A_log, D, dt_bias directly under it, then its submodules)."""
    subs = ("in_proj", "conv1d", "norm", "out_proj")
    return {hub: core, **{f"{hub}.{m}": f"{core}.{m}" for m in subs}}


class GraniteHybridConfig(DecoderConfig):
    """Defaults are transformers' GraniteMoeHybridConfig's."""

    model_type: Literal["granitemoehybrid"] = "granitemoehybrid"
    vocab_size: PositiveInt = 32000
    hidden_size: PositiveInt = 4096
    intermediate_size: PositiveInt = 11008  # each routed expert's width
    num_hidden_layers: PositiveInt = 32
    num_attention_heads: PositiveInt = 32
    bos_token_id: NonNegativeInt | None = 1
    eos_token_id: NonNegativeInt | list[NonNegativeInt] | None = 2
    # differs from llama3: Granite's multipliers
    embedding_multiplier: PositiveFloat = 1.0
    residual_multiplier: PositiveFloat = 1.0
    attention_multiplier: PositiveFloat = 1.0
    logits_scaling: PositiveFloat = 1.0
    # the MLP: a shared SwiGLU on every layer, routed experts beside it when there are any
    num_local_experts: NonNegativeInt = 8
    num_experts_per_tok: NonNegativeInt = 2
    shared_intermediate_size: PositiveInt = 1024
    position_embedding_type: Literal["rope", "nope"] | None = None  # None: no rope
    # the Mamba2 layers
    mamba_n_heads: PositiveInt = 128
    mamba_n_groups: PositiveInt = 1
    mamba_d_state: PositiveInt = 256
    mamba_d_head: PositiveInt | Literal["auto"] = "auto"
    mamba_d_conv: PositiveInt = 4
    mamba_expand: PositiveInt = 2
    mamba_chunk_size: PositiveInt = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] | None = (0.0, float("inf"))

    @field_validator("time_step_limit", mode="before")
    @classmethod
    def _infinity(cls, v: Any) -> Any:
        return json_floats(v)

    def layer_kinds(self) -> list[str]:
        """ "mamba" or "attention" per layer (transformers 5's "linear_attention" and
        "full_attention" too); absent `layer_types`: every layer Mamba2, as transformers."""
        n = self.num_hidden_layers
        kinds = self.layer_types if self.layer_types is not None else ["mamba"] * n
        if len(kinds) < n or {k for k in kinds[:n]} - {*MAMBA, *ATTENTION}:
            raise ConfigError(
                f"config.json: field 'layer_types' must give 'mamba' or 'attention' per layer "
                f"(num_hidden_layers={n}); got {kinds!r}"
            )
        return ["mamba" if k in MAMBA else "attention" for k in kinds[:n]]

    def layer_windows(self) -> list[int | None]:
        return [None] * self.num_hidden_layers  # differs: no sliding windows

    def layer_ropes(self) -> list[bool]:
        return [self.position_embedding_type == "rope"] * self.num_hidden_layers  # else NoPE

    def attention_spec(self) -> GQASpec:
        # differs from llama3: the softmax scale is attention_multiplier, not head_dim ** -0.5
        return replace(super().attention_spec(), softmax_scale=self.attention_multiplier)

    def mamba_spec(self) -> Mamba2Spec:
        return mamba2_spec(self, self.mamba_expand * self.hidden_size)

    def attention_layers(self, base: Any) -> tuple[Any, ...]:
        mamba, specs = self.mamba_spec(), super().attention_layers(base)
        return tuple(
            mamba if k == "mamba" else s for k, s in zip(self.layer_kinds(), specs, strict=True)
        )

    def mlp_spec(self) -> DenseMLPSpec:
        # no experts: the shared MLP is the whole MLP (else unused: every layer is MoE)
        return DenseMLPSpec(self.shared_intermediate_size)

    def moe_spec(self) -> MoESpec | None:
        if not self.num_local_experts:
            return None
        # softmax over the top-k logits = the softmax's top k renormalised
        width = self.shared_intermediate_size
        return every_layer_moe(
            self, "num_local_experts", self.intermediate_size, shared_intermediate_size=width
        )

    def embedding_spec(self) -> EmbeddingSpec:
        return EmbeddingSpec(scale=self.embedding_multiplier)

    def logits_scale(self) -> float:
        return 1.0 / self.logits_scaling

    def to_runtime(self) -> RuntimeConfig:
        return replace(super().to_runtime(), residual_scale=self.residual_multiplier)

    def adapt_weight_map(self, base: dict[str, Any]) -> dict[str, Any]:
        # no experts: the shared MLP is the core's dense MLP, not the MoE's shared expert
        return base if self.num_local_experts else {**base, **_DENSE}


_L = "model.layers.{}"
_MOE = f"{_L}.block_sparse_moe"
WEIGHT_MAP = {
    **LLAMA3_WEIGHT_MAP,
    # the Mamba2 mixer runs as the block's self_attn, under its hub names
    **mamba2_names(f"{_L}.mamba", f"{_L}.self_attn"),
    # the routed experts, stored stacked: input_linear is [gate | up] per expert
    f"{_MOE}.router.layer": f"{_L}.mlp.gate",
    f"{_MOE}.input_linear": f"{_L}.mlp.experts.gate_up_proj",
    f"{_MOE}.output_linear": f"{_L}.mlp.experts.down_proj",
    f"{_L}.shared_mlp.input_linear": f"{_L}.mlp.shared_experts.gate_up_proj",
    f"{_L}.shared_mlp.output_linear": f"{_L}.mlp.shared_experts.down_proj",
    # GGUF files (llama.cpp splits gate | up): one tensor per expert, the shared MLP's parts
    **ROUTED_EXPERTS,
    f"{_L}.mlp.shared_experts.gate_proj": (f"{_L}.mlp.shared_experts.gate_up_proj", "gate"),
    f"{_L}.mlp.shared_experts.up_proj": (f"{_L}.mlp.shared_experts.gate_up_proj", "up"),
}
_DENSE = {
    f"{_L}.shared_mlp.input_linear": f"{_L}.mlp.gate_up_proj",
    f"{_L}.shared_mlp.output_linear": f"{_L}.mlp.down_proj",
}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture("granitemoehybrid", GraniteHybridConfig, WEIGHT_MAP)
