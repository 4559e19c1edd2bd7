"""gpt-oss (model_type `gpt_oss`: openai/gpt-oss-20b, gpt-oss-120b), as a delta of Llama 3:
- attention: window-128 and full layers alternating (`layer_types`; absent: even layers
  slide), a learned sink logit per query head (`self_attn.sinks`), biases on q/k/v/o;
- rope: YaRN with `truncate: false` (the correction range is not rounded to whole dims);
- every MLP a mixture of experts: the router has a bias, softmax over the top-k logits (the
  core's softmax top-k renormalised: the same weights); each expert has biases and gpt-oss's
  clamped SwiGLU over interleaved (gate, up) rows (`GLUSpec`).

Checkpoints store the experts stacked and transposed, (E, H, 2I) `mlp.experts.gate_up_proj`
and (E, I, H) `down_proj` (transformers' names), or, as released, in MXFP4
(`gate_up_proj_blocks` + `_scales`, read dequantized by plugins/formats/safetensors_mxfp4.py) in the
(E, 2I, H) / (E, H, I) orientation the core keeps; both keep gate/up interleaved, as the core's
gpt-oss experts do.
"""

from dataclasses import replace
from typing import Literal

from pydantic import AliasChoices, Field, PositiveFloat, PositiveInt

from core.config import GLUSpec, GQASpec, MoESpec
from core.hfconfig import DecoderConfig, every_layer_moe
from core.hookspecs import hookimpl
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP

# transformers' GptOssConfig default when the config has no rope keys (hub configs spell it out)
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


class GptOssConfig(DecoderConfig):
    """Defaults are transformers' GptOssConfig's (gpt-oss-120b's shape)."""

    model_type: Literal["gpt_oss"] = "gpt_oss"
    num_key_value_heads: PositiveInt | None = 8
    head_dim: PositiveInt | None = 64  # differs from llama3: explicit (64 heads x 64 != 2880)
    rms_norm_eps: PositiveFloat = 1e-5
    max_position_embeddings: PositiveInt = 131072
    attention_bias: bool = True
    sliding_window: PositiveInt | None = 128
    default_rope_theta = 150000.0
    num_local_experts: PositiveInt = Field(
        128, validation_alias=AliasChoices("num_local_experts", "num_experts")
    )
    num_experts_per_tok: PositiveInt = 4
    swiglu_alpha: PositiveFloat = 1.702
    swiglu_limit: PositiveFloat = 7.0

    def default_layer_kinds(self) -> list[str]:
        # differs from llama3: sliding on even layers, full on odd ones (transformers' default)
        return ["sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(self.num_hidden_layers)]  # fmt: skip

    def attention_spec(self) -> GQASpec:
        # differs from llama3: a learned sink logit per query head on every layer
        return replace(DecoderConfig.attention_spec(self), sinks=True)

    def rope_params(self):
        if self.rope_parameters is None and self.rope_scaling is None:
            return "yarn", {k: v for k, v in DEFAULT_ROPE.items() if k != "rope_type"}
        return DecoderConfig.rope_params(self)

    def moe_spec(self) -> MoESpec:
        # softmax over the top-k logits == the renormalised top-k softmax of every_layer_moe;
        # differs from mixtral: biases on the router and experts, gpt-oss's clamped SwiGLU
        glu = GLUSpec(alpha=self.swiglu_alpha, limit=self.swiglu_limit)
        return every_layer_moe(
            self, "num_local_experts", self.intermediate_size, bias=True, glu=glu
        )


_E = "model.layers.{}.mlp.experts"
WEIGHT_MAP = {
    **LLAMA3_WEIGHT_MAP,
    # differs from llama3: the router is mlp.router (weight and bias) -> the core's mlp.gate
    "model.layers.{}.mlp.router": "model.layers.{}.mlp.gate",
    # stacked experts, transposed (transformers' layout): written through the "T" view shard
    f"{_E}.gate_up_proj": (f"{_E}.gate_up_proj.weight", "T"),
    f"{_E}.down_proj": (f"{_E}.down_proj.weight", "T"),
    f"{_E}.gate_up_proj_bias": f"{_E}.gate_up_proj.bias",
    f"{_E}.down_proj_bias": f"{_E}.down_proj.bias",
    # MXFP4 (the released checkpoints): dequantized by the reader, already (E, out, in)
    f"{_E}.gate_up_proj_blocks": f"{_E}.gate_up_proj.weight",
    f"{_E}.down_proj_blocks": f"{_E}.down_proj.weight",
}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture(("gpt_oss",), GptOssConfig, WEIGHT_MAP)
