"""Llama 4 (model_type `llama4_text`, and `llama4`: Scout, Maverick), as a delta of Llama 3:
- rope ("iRoPE"): every `no_rope_layer_interval`-th layer (4) runs without rope, or each as
  `no_rope_layers` says (1: rope, 0: none); rope pairs dims (2i, 2i + 1) (complex rotation);
- the roped layers attend within chunks of `attention_chunk_size` tokens (`layer_types`
  "chunked_attention" where transformers 5 writes them) and L2-norm q and k, without weight
  (`use_qk_norm`); the NoPE layers see all tokens and scale q by a temperature
  that grows with the position (`attn_temperature_tuning`, `floor_scale`, `attn_scale`);
- a mixture of experts on every `interleave_moe_layer_step`-th layer (or `moe_layers`), the
  others dense of `intermediate_size_mlp`: top-k by the router's logits, each chosen expert
  run on sigmoid(logit) * x (the weight scales the expert's input, not its output), plus
  one shared expert of `intermediate_size`.

Checkpoints name the MLP `feed_forward` and store the routed experts stacked and transposed,
(E, H, 2I) `experts.gate_up_proj` ([gate | up] columns) and (E, I, H) `experts.down_proj`;
`llama4` repos (Llama4ForConditionalGeneration) keep the text model under `language_model.`,
beside a vision model and projector that are not run.
"""

from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, Field, NonNegativeInt, PositiveFloat, PositiveInt

from core.config import DenseMLPSpec, L2NormSpec, MoESpec, QueryScale, RopeSpec
from core.errors import ConfigError
from core.hfconfig import DecoderConfig, routed_top_k, text_model, text_model_weights
from core.hookspecs import hookimpl
from plugins.llama3 import WEIGHT_MAP as LLAMA3_WEIGHT_MAP

LAYER_KINDS = ("full_attention", "chunked_attention")


class Llama4TextConfig(DecoderConfig):
    """Defaults are transformers' Llama4TextConfig's (Scout's shape)."""

    model_type: Literal["llama4_text"] = "llama4_text"
    vocab_size: PositiveInt = 202048
    hidden_size: PositiveInt = 5120
    num_hidden_layers: PositiveInt = 48
    num_attention_heads: PositiveInt = 40
    num_key_value_heads: PositiveInt | None = 8
    head_dim: PositiveInt | None = 128
    intermediate_size: PositiveInt = 8192  # per routed expert, and the shared expert's
    rms_norm_eps: PositiveFloat = 1e-5
    max_position_embeddings: PositiveInt = 131072
    bos_token_id: NonNegativeInt | None = 1
    eos_token_id: NonNegativeInt | list[NonNegativeInt] | None = 2
    default_rope_theta: ClassVar[float] = 500000.0
    # differs from llama3: NoPE layers, chunked attention, q/k norm, temperature tuning
    no_rope_layers: list[Literal[0, 1]] | None = None
    no_rope_layer_interval: PositiveInt = 4
    attention_chunk_size: PositiveInt | None = 8192
    use_qk_norm: bool = True
    attn_temperature_tuning: bool | NonNegativeInt = True  # Scout's config.json says 4
    floor_scale: PositiveFloat = 8192
    attn_scale: float = 0.1
    # differs from llama3: experts on some layers, dense MLPs of their own width on the others
    intermediate_size_mlp: PositiveInt = 16384
    num_local_experts: PositiveInt = Field(
        16, validation_alias=AliasChoices("num_local_experts", "num_experts")
    )
    num_experts_per_tok: PositiveInt = 1
    moe_layers: list[NonNegativeInt] | None = None
    interleave_moe_layer_step: PositiveInt = 1

    def layer_ropes(self) -> list[bool]:
        n = self.num_hidden_layers
        if not self.no_rope_layers:  # transformers: absent or [] -> every interval-th NoPE
            return [(i + 1) % self.no_rope_layer_interval != 0 for i in range(n)]
        if len(self.no_rope_layers) < n:
            raise ConfigError(
                f"config.json: field 'no_rope_layers' lists {len(self.no_rope_layers)} layers "
                f"for num_hidden_layers={n}; give a 1 (rope) or 0 (NoPE) per layer"
            )
        return [bool(x) for x in self.no_rope_layers[:n]]

    def layer_kinds(self) -> list[str]:
        # differs from llama3: chunked layers; absent layer_types, the roped layers are chunked
        n, chunk = self.num_hidden_layers, self.attention_chunk_size
        if self.layer_types is None:
            kind = "full_attention" if chunk is None else "chunked_attention"
            return [kind if roped else "full_attention" for roped in self.layer_ropes()]
        kinds = self.layer_types[:n]
        bad = sorted({k for k in kinds if k not in LAYER_KINDS})
        if len(kinds) < n or bad:
            raise ConfigError(
                f"config.json: field 'layer_types' must give one of {', '.join(LAYER_KINDS)} "
                f"for each of the {n} layers (got {self.layer_types!r})"
            )
        if chunk is None and "chunked_attention" in kinds:
            raise ConfigError(
                "config.json: field 'layer_types' has chunked_attention layers, but field "
                "'attention_chunk_size' is not set; set it to the chunk in tokens"
            )
        return kinds

    def layer_windows(self) -> list[int | None]:
        return [None] * self.num_hidden_layers  # no sliding windows

    def attention_layers(self, base: Any) -> tuple[Any, ...]:
        norm = L2NormSpec(self.rms_norm_eps) if self.use_qk_norm else None
        temperature = QueryScale(self.attn_scale, float(self.floor_scale), 1, round_factor=False)
        specs = []
        for spec, kind in zip(super().attention_layers(base), self.layer_kinds(), strict=True):
            chunk = self.attention_chunk_size if kind == "chunked_attention" else None
            if spec.rope == "none":  # differs from smollm3: a temperature on NoPE queries
                tuned = temperature if self.attn_temperature_tuning else None
                specs.append(replace(spec, chunk=chunk, query_scale=tuned))
            else:  # q/k L2-normed on the roped layers only; transformers norms after rope,
                # the core before: a rotation keeps each head's norm, so the two agree
                specs.append(replace(spec, chunk=chunk, qk_norm=norm))
        return tuple(specs)

    def rope_spec(self) -> RopeSpec:
        return replace(super().rope_spec(), interleaved=True)  # (x_2i, x_2i+1) pairs

    def mlp_spec(self) -> DenseMLPSpec:
        return DenseMLPSpec(self.intermediate_size_mlp, act=self.hidden_act)

    def moe_layer_list(self) -> tuple[int, ...]:
        n, step = self.num_hidden_layers, self.interleave_moe_layer_step
        if self.moe_layers is None:  # transformers: step - 1, 2 * step - 1, ...
            return tuple(range(step - 1, n, step))
        outside = sorted(i for i in self.moe_layers if i >= n)
        if outside:
            raise ConfigError(
                f"config.json: field 'moe_layers' names layers {outside}, but the model has "
                f"num_hidden_layers={n} (layers 0..{n - 1}); remove them"
            )
        return tuple(sorted(set(self.moe_layers)))

    def moe_spec(self) -> MoESpec | None:
        layers = self.moe_layer_list()
        if not layers:
            return None
        e = self.num_local_experts
        return MoESpec(
            num_experts=e,
            top_k=routed_top_k(self.num_experts_per_tok, e, "num_local_experts"),
            intermediate_size=self.intermediate_size,
            num_shared_experts=1,
            layers=layers,
            scoring="sigmoid",  # sigmoid is monotonic: top-k by score is top-k by logit
            topk_method="greedy",
            scale_input=True,
        )


class Llama4Config(Llama4TextConfig):
    """A multimodal Llama 4 (`llama4`: the released Scout and Maverick repos): its
    `text_config` is the text model Zoo runs; the vision model and projector are skipped."""

    model_type: Literal["llama4"] = "llama4"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "Llama4Config":
        return super().from_dict(text_model(raw, source, "llama4"), source)


_L = "model.layers.{}"
_F = f"{_L}.feed_forward"
WEIGHT_MAP = {
    **LLAMA3_WEIGHT_MAP,
    # differs from llama3: the MLP is `feed_forward`; dense layers fuse gate/up as Llama's
    f"{_F}.gate_proj": (f"{_L}.mlp.gate_up_proj", "gate"),
    f"{_F}.up_proj": (f"{_L}.mlp.gate_up_proj", "up"),
    f"{_F}.down_proj": f"{_L}.mlp.down_proj",
    # MoE layers: the router, one shared expert, the routed experts stacked and transposed
    f"{_F}.router": f"{_L}.mlp.gate",
    f"{_F}.shared_expert.gate_proj": (f"{_L}.mlp.shared_experts.gate_up_proj", "gate"),
    f"{_F}.shared_expert.up_proj": (f"{_L}.mlp.shared_experts.gate_up_proj", "up"),
    f"{_F}.shared_expert.down_proj": f"{_L}.mlp.shared_experts.down_proj",
    # one tensor per expert (what GGUF files hold, read by their hub names)
    f"{_F}.experts.{{}}.gate_proj": (f"{_L}.mlp.experts.gate_up_proj", "{}.gate"),
    f"{_F}.experts.{{}}.up_proj": (f"{_L}.mlp.experts.gate_up_proj", "{}.up"),
    f"{_F}.experts.{{}}.down_proj": (f"{_L}.mlp.experts.down_proj", "{}"),
    f"{_F}.experts.gate_up_proj": (f"{_L}.mlp.experts.gate_up_proj.weight", "T"),
    f"{_F}.experts.down_proj": (f"{_L}.mlp.experts.down_proj.weight", "T"),
}
# a llama4 repo: the text model under language_model.*; the vision side is not run
MULTIMODAL_WEIGHT_MAP = text_model_weights(WEIGHT_MAP, ("vision_model", "multi_modal_projector"))


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture("llama4_text", Llama4TextConfig, WEIGHT_MAP)
    registry.add_architecture("llama4", Llama4Config, MULTIMODAL_WEIGHT_MAP)
