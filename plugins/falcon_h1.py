"""TII Falcon-H1 (model_type `falcon_h1`): every layer runs GQA attention and a Mamba2 mixer in
parallel on the same normed input and sums them (core/layers/parallel_mixer.py), then a SwiGLU
MLP; a delta of Llama 3.

Falcon-H1's muP multipliers, and where they go:
- folded into the weights as they load (`weight_scales`: a constant times a linear layer, so
  equal to transformers' to fp32 rounding): attention_in_multiplier (q, k, v weights),
  key_multiplier (k weight and bias), attention_out_multiplier (o_proj), ssm_in_multiplier
  (mamba in_proj weight), ssm_multipliers (in_proj rows z | x | B | C | dt, weight and bias: the
  `mup_vector`), ssm_out_multiplier (mamba out_proj), mlp_multipliers (gate_proj, down_proj);
- at run time: embedding_multiplier (EmbeddingSpec.scale: the embedding is tied to the head in
  some checkpoints) and lm_head_multiplier (the logits scale).
llama.cpp's converter folds the same ones into its GGUF files (embedding and head too).
The Mamba2 gated norm is optional (`mamba_rms_norm`; without it y * silu(z)) and may norm
before the gate (`mamba_norm_before_gate`); `projectors_bias` is the mamba out_proj's bias.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import NonNegativeInt, PositiveFloat, PositiveInt, field_validator

from core.config import EmbeddingSpec
from core.config_kinds import Mamba2Spec, ParallelMixerSpec
from core.hfconfig import DecoderConfig, json_floats
from core.hookspecs import hookimpl
from plugins.granite_hybrid import mamba2_names, mamba2_spec
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP


class FalconH1Config(DecoderConfig):
    """Defaults are transformers' FalconH1Config's."""

    model_type: Literal["falcon_h1"] = "falcon_h1"
    vocab_size: PositiveInt = 128000
    hidden_size: PositiveInt = 4096
    intermediate_size: PositiveInt = 14336
    num_hidden_layers: PositiveInt = 32
    num_attention_heads: PositiveInt = 32
    num_key_value_heads: PositiveInt | None = 8
    rms_norm_eps: PositiveFloat = 1e-5
    max_position_embeddings: PositiveInt = 8192
    bos_token_id: NonNegativeInt | None = 1
    eos_token_id: NonNegativeInt | list[NonNegativeInt] | None = 2
    # the Mamba2 mixer beside each attention
    mamba_d_ssm: PositiveInt | None = 1024  # None: mamba_expand * hidden_size
    mamba_n_heads: PositiveInt = 128
    mamba_d_head: PositiveInt | Literal["auto"] = "auto"
    mamba_n_groups: PositiveInt = 1
    mamba_d_state: PositiveInt = 256
    mamba_d_conv: PositiveInt = 4
    mamba_expand: PositiveInt = 2
    mamba_chunk_size: PositiveInt = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False  # in_proj's bias
    projectors_bias: bool = False  # the mamba out_proj's bias
    mamba_norm_before_gate: bool = True
    mamba_rms_norm: bool = False
    time_step_limit: tuple[float, float] | None = (0.0, float("inf"))
    # the muP multipliers (see the module docstring)
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    mlp_multipliers: tuple[float, float] | None = None  # gate, down; None: 1, 1
    ssm_multipliers: tuple[float, float, float, float, float] | None = None  # z, x, B, C, dt

    @field_validator("time_step_limit", mode="before")
    @classmethod
    def _infinity(cls, v: Any) -> Any:
        return json_floats(v)

    def layer_windows(self) -> list[int | None]:
        return [None] * self.num_hidden_layers  # differs: every layer is hybrid, none slides

    def mamba_width(self) -> int:
        return (
            self.mamba_expand * self.hidden_size if self.mamba_d_ssm is None else self.mamba_d_ssm
        )

    def mamba_spec(self) -> Mamba2Spec:
        norm = "norm_first" if self.mamba_norm_before_gate else "gate_first"
        return mamba2_spec(
            self,
            self.mamba_width(),
            "mamba_d_ssm (or mamba_expand x hidden_size)",
            out_bias=self.projectors_bias,
            gated_norm=norm if self.mamba_rms_norm else "none",
        )

    def attention_layers(self, base: Any) -> tuple[Any, ...]:
        # differs from llama3: attention and Mamba2 side by side on every layer
        mixer = ParallelMixerSpec(attention=base, mamba=self.mamba_spec())
        return (mixer,) * self.num_hidden_layers

    def embedding_spec(self) -> EmbeddingSpec:
        return EmbeddingSpec(scale=self.embedding_multiplier)

    def logits_scale(self) -> float:
        return self.lm_head_multiplier

    def weight_scales(self) -> dict[str, Any]:
        ai, km, ao = (
            self.attention_in_multiplier,
            self.key_multiplier,
            self.attention_out_multiplier,
        )
        gate, down = self.mlp_multipliers or (1.0, 1.0)
        z, x, b, c, dt = self.ssm_multipliers or (1.0,) * 5
        width, gn = self.mamba_width(), self.mamba_n_groups * self.mamba_d_state
        rows = (width, width, gn, gn, self.mamba_n_heads)  # in_proj: z | x | B | C | dt
        mup = tuple(zip(rows, (z, x, b, c, dt), strict=True))
        ssm_in = tuple((n, f * self.ssm_in_multiplier) for n, f in mup)
        a, m, f = f"{_L}.self_attn", f"{_L}.mamba", f"{_L}.feed_forward"
        scales = {
            f"{a}.q_proj.weight": ai,
            f"{a}.k_proj.weight": ai * km,
            f"{a}.k_proj.bias": km,
            f"{a}.v_proj.weight": ai,
            f"{a}.o_proj.weight": ao,
            f"{a}.o_proj.bias": ao,
            f"{m}.in_proj.weight": ssm_in,
            f"{m}.in_proj.bias": mup,
            f"{m}.out_proj.weight": self.ssm_out_multiplier,
            f"{m}.out_proj.bias": self.ssm_out_multiplier,
            f"{f}.gate_proj.weight": gate,
            f"{f}.gate_proj.bias": gate,
            f"{f}.down_proj.weight": down,
            f"{f}.down_proj.bias": down,
        }
        return {k: v for k, v in scales.items() if not _is_one(v)}


def _is_one(v: Any) -> bool:
    """A factor (or every segment's) of 1: nothing to fold."""
    return all(f == 1.0 for _, f in v) if isinstance(v, tuple) else v == 1.0


_L = "model.layers.{}"
_ATTN = {
    f"{_L}.self_attn.{p}": (f"{_L}.self_attn.attn.qkv_proj", p[0])
    for p in ("q_proj", "k_proj", "v_proj")
}
WEIGHT_MAP = {
    **LLAMA3_WEIGHT_MAP,
    # the attention and the Mamba2 mixer run as the block's self_attn (a ParallelMixer)
    **_ATTN,
    f"{_L}.self_attn.o_proj": f"{_L}.self_attn.attn.o_proj",
    **mamba2_names(f"{_L}.mamba", f"{_L}.self_attn.mamba"),
    # the MLP is feed_forward, behind pre_ff_layernorm; the final norm is final_layernorm
    f"{_L}.feed_forward.gate_proj": (f"{_L}.mlp.gate_up_proj", "gate"),
    f"{_L}.feed_forward.up_proj": (f"{_L}.mlp.gate_up_proj", "up"),
    f"{_L}.feed_forward.down_proj": f"{_L}.mlp.down_proj",
    f"{_L}.pre_ff_layernorm": f"{_L}.post_attention_layernorm",
    "model.final_layernorm": "model.norm",
}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture("falcon_h1", FalconH1Config, WEIGHT_MAP)
