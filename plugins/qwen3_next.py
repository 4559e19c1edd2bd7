"""Hybrid linear attention: Qwen3-Next (`qwen3_next`), Qwen3.5 (`qwen3_5`, `qwen3_5_text`) and
Qwen3.5-MoE (`qwen3_5_moe`, `qwen3_5_moe_text`), as a delta of Qwen3-MoE.

Three gated-DeltaNet layers (`linear_attention`: core/layers/deltanet.py) to each gated
attention layer (`full_attention`): Qwen3's attention with a sigmoid output gate from q_proj,
rope on the first partial_rotary_factor of each head, and zero-centred (1 + w) RMSNorms, as in
every norm of the decoder. MLPs are MoE with one shared expert behind a sigmoid gate
(Qwen3-Next, Qwen3.5-MoE) or dense (Qwen3.5). Multi-token-prediction weights (`mtp.*`) are not
loaded. Qwen3.5's configs nest the text model under `text_config` (like gemma3) and its
checkpoints hold a vision tower, skipped at load.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt

from core.config import GQASpec, MoESpec, RMSNormSpec
from core.config_kinds import GatedDeltaNetSpec
from core.errors import ConfigError
from core.hfconfig import every_layer_moe, text_model
from core.hookspecs import hookimpl
from plugins.qwen3_moe import WEIGHT_MAP as QWEN3_MOE_WEIGHT_MAP
from plugins.qwen3_moe import Qwen3MoeConfig

KINDS = ("linear_attention", "full_attention")


class Qwen3NextConfig(Qwen3MoeConfig):
    """Defaults are transformers' Qwen3NextConfig's."""

    model_type: Literal["qwen3_next"] = "qwen3_next"
    head_dim: PositiveInt = 256
    num_key_value_heads: PositiveInt | None = 2
    norm_topk_prob: bool = True
    num_experts: NonNegativeInt = 512
    num_experts_per_tok: PositiveInt = 10
    moe_intermediate_size: PositiveInt = 512
    shared_expert_intermediate_size: NonNegativeInt = 512
    # the linear-attention layers
    linear_conv_kernel_dim: PositiveInt = 4
    linear_key_head_dim: PositiveInt = 128
    linear_value_head_dim: PositiveInt = 128
    linear_num_key_heads: PositiveInt = 16
    linear_num_value_heads: PositiveInt = 32
    full_attention_interval: PositiveInt = 4  # absent `layer_types`: every 4th layer attends
    partial_rotary_factor: float = Field(0.25, gt=0, le=1)
    rope_theta: PositiveFloat | None = None
    default_rope_theta = 10_000.0
    layout: Literal["grouped", "flat"] = "grouped"  # how in_proj is stored (not a hub key)

    def layer_kinds(self) -> list[str]:
        n = self.num_hidden_layers
        kinds = self.layer_types
        if kinds is None:
            p = self.full_attention_interval
            kinds = ["linear_attention" if (i + 1) % p else "full_attention" for i in range(n)]
        if len(kinds) < n or sorted(set(kinds[:n]) - set(KINDS)):
            raise ConfigError(
                f"config.json: field 'layer_types' must give one of {', '.join(KINDS)} per layer "
                f"(num_hidden_layers={n}); got {kinds!r}"
            )
        return list(kinds[:n])

    def layer_windows(self) -> list[int | None]:
        return [None] * self.num_hidden_layers  # differs: no sliding windows

    def norm_spec(self) -> RMSNormSpec:
        return RMSNormSpec(self.rms_norm_eps, offset=1.0)  # differs: zero-centred, (1 + w)

    def attention_spec(self) -> GQASpec:
        # differs from qwen3_moe: (1 + w) q/k norms and a sigmoid gate on the output
        return replace(super().attention_spec(), qk_norm=self.norm_spec(), output_gate=True)

    def linear_spec(self) -> GatedDeltaNetSpec:
        nk, nv = self.linear_num_key_heads, self.linear_num_value_heads
        if nv % nk:
            raise ConfigError(
                f"config.json: linear_num_value_heads ({nv}) is not a multiple of "
                f"linear_num_key_heads ({nk})"
            )
        if self.linear_conv_kernel_dim < 2:
            raise ConfigError("config.json: field 'linear_conv_kernel_dim' must be at least 2")
        return GatedDeltaNetSpec(
            num_k_heads=nk,
            num_v_heads=nv,
            head_k_dim=self.linear_key_head_dim,
            head_v_dim=self.linear_value_head_dim,
            conv_kernel=self.linear_conv_kernel_dim,
            norm_eps=self.rms_norm_eps,
            layout=self.layout,
        )

    def attention_layers(self, base: Any) -> tuple[Any, ...]:
        linear = self.linear_spec()
        return tuple(linear if k == "linear_attention" else base for k in self.layer_kinds())

    def rope_params(self) -> tuple[str, dict[str, Any]]:
        kind, params = super().rope_params()
        # Qwen3.5's multimodal rope sections: for text all three positions are the token's,
        # which makes it plain rope
        for key in ("partial_rotary_factor", "mrope_section", "mrope_interleaved"):
            params.pop(key, None)
        return kind, params

    def rope_dim(self) -> int:
        return self.partial_rope_dim(self.partial_rotary_factor)  # differs: part of each head

    def moe_spec(self) -> MoESpec | None:
        spec = super().moe_spec()
        if spec is None:
            return None
        # differs from qwen3_moe: one shared expert of its own width, behind a sigmoid gate
        width = self.shared_expert_intermediate_size
        return replace(spec, shared_intermediate_size=width, shared_gate=width > 0)

    def mtp_layers(self) -> int:
        return 0  # stored under mtp.*, skipped by the weight map


class Qwen35TextConfig(Qwen3NextConfig):
    """Qwen3.5's (dense) text model: in_proj stored flat, dense MLPs. Defaults are
    transformers' Qwen3_5TextConfig's."""

    model_type: Literal["qwen3_5_text", "qwen3_5"] = "qwen3_5_text"
    vocab_size: PositiveInt = 248320
    hidden_size: PositiveInt = 4096
    intermediate_size: PositiveInt = 12288
    num_hidden_layers: PositiveInt = 32
    num_key_value_heads: PositiveInt | None = 4
    layout: Literal["grouped", "flat"] = "flat"

    def moe_spec(self) -> MoESpec | None:
        return None  # differs from qwen3_next: dense MLPs


class Qwen35MoeTextConfig(Qwen3NextConfig):
    """Qwen3.5-MoE's text model: in_proj stored flat, every layer MoE with top-k weights
    renormalised. Defaults are transformers' Qwen3_5MoeTextConfig's."""

    model_type: Literal["qwen3_5_moe_text", "qwen3_5_moe"] = "qwen3_5_moe_text"
    vocab_size: PositiveInt = 248320
    intermediate_size: PositiveInt = 5632  # no dense MLP: the hub configs leave it out
    num_experts: NonNegativeInt = 256
    num_experts_per_tok: PositiveInt = 8
    layout: Literal["grouped", "flat"] = "flat"

    def moe_spec(self) -> MoESpec | None:
        width = self.shared_expert_intermediate_size
        return every_layer_moe(
            self,
            "num_experts",
            self.moe_intermediate_size,
            shared_intermediate_size=width,
            shared_gate=width > 0,
        )


class Qwen35Config(Qwen35TextConfig):
    """A Qwen3.5 checkpoint (`qwen3_5`, image-text-to-text): its `text_config` is run."""

    @classmethod
    def from_dict(cls, raw: Any, source: str = "config.json") -> Qwen35Config:
        return super().from_dict(text_model(raw, source, "qwen3_5"), source)


class Qwen35MoeConfig(Qwen35MoeTextConfig):
    """A Qwen3.5-MoE checkpoint (`qwen3_5_moe`): its `text_config` is run."""

    @classmethod
    def from_dict(cls, raw: Any, source: str = "config.json") -> Qwen35MoeConfig:
        return super().from_dict(text_model(raw, source, "qwen3_5_moe"), source)


_L = "model.layers.{}"
_LINEAR = {  # the linear-attention layer runs as the block's self_attn
    f"{_L}.linear_attn": f"{_L}.self_attn",  # A_log, dt_bias
    f"{_L}.linear_attn.conv1d": f"{_L}.self_attn.conv1d",
    f"{_L}.linear_attn.norm": f"{_L}.self_attn.norm",
    f"{_L}.linear_attn.out_proj": f"{_L}.self_attn.out_proj",
}
_SHARED = {  # differs from qwen3_moe: one gated shared expert (mlp.shared_expert_gate: identity)
    f"{_L}.mlp.shared_expert.gate_proj": (f"{_L}.mlp.shared_experts.gate_up_proj", "gate"),
    f"{_L}.mlp.shared_expert.up_proj": (f"{_L}.mlp.shared_experts.gate_up_proj", "up"),
    f"{_L}.mlp.shared_expert.down_proj": f"{_L}.mlp.shared_experts.down_proj",
}
WEIGHT_MAP = {
    **QWEN3_MOE_WEIGHT_MAP,
    **_LINEAR,
    **_SHARED,
    f"{_L}.linear_attn.in_proj_qkvz": (f"{_L}.self_attn.in_proj", "qkvz"),
    f"{_L}.linear_attn.in_proj_ba": (f"{_L}.self_attn.in_proj", "ba"),
    "mtp.*": None,  # multi-token prediction: not run
}
QWEN3_5_TEXT_WEIGHT_MAP = {
    **QWEN3_MOE_WEIGHT_MAP,
    **_LINEAR,
    **_SHARED,
    **{
        f"{_L}.linear_attn.in_proj_{p}": (f"{_L}.self_attn.in_proj", p)
        for p in ("qkv", "z", "b", "a")
    },
    "mtp.*": None,
}
# the multimodal checkpoints: the text model under model.language_model.*, a vision tower
QWEN3_5_WEIGHT_MAP = {
    **QWEN3_5_TEXT_WEIGHT_MAP,
    "model.language_model.*": "model.*",
    "model.visual.*": None,
}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture("qwen3_next", Qwen3NextConfig, WEIGHT_MAP)
    registry.add_architecture("qwen3_5_text", Qwen35TextConfig, QWEN3_5_TEXT_WEIGHT_MAP)
    registry.add_architecture("qwen3_5", Qwen35Config, QWEN3_5_WEIGHT_MAP)
    registry.add_architecture("qwen3_5_moe_text", Qwen35MoeTextConfig, QWEN3_5_TEXT_WEIGHT_MAP)
    registry.add_architecture("qwen3_5_moe", Qwen35MoeConfig, QWEN3_5_WEIGHT_MAP)
