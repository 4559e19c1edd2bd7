"""Gemma 4's text model (`gemma4_text`, and a multimodal `gemma4` config's `text_config`), a
delta of Gemma 3's (plugins/gemma.py): the same sandwich norms, GeGLU MLP, scaled embeddings and
five window layers to one global layer, plus

- norms that multiply by w itself (not 1 + w), in fp32 (`RMSNormSpec(fp32_scale=True)`);
- q, k and v normed per head (v by a weightless norm, `GQASpec.v_norm`), softmax scale 1;
- global layers with their own head_dim (`global_head_dim`), kv heads
  (`num_global_key_value_heads`, with `attention_k_eq_v`: values are k_proj's output) and a
  rope that turns only a quarter of each head's frequencies (`ProportionalRope`);
- per-layer embeddings (`PerLayerInputSpec`) and a learned scalar on each block's output;
- the last `num_kv_shared_layers` layers computing no K/V: each attends over the K/V of the
  last earlier layer of its kind (`GQASpec.kv_source`), with double-wide MLPs if
  `use_double_wide_mlp`.
The MoE models (`enable_moe_block`, 26B-A4B) run a dense MLP and routed GeGLU experts side by
side on every layer (`DenseMoESpec`), and K = V on their global layers (`attention_k_eq_v`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import NonNegativeInt, PositiveFloat, PositiveInt

from core.config import (
    DefaultRope,
    DenseMLPSpec,
    GQASpec,
    MoESpec,
    ProportionalRope,
    RMSNormSpec,
    RopeSpec,
    RuntimeConfig,
)
from core.config_kinds import DenseMoESpec, PerLayerInputSpec
from core.errors import ConfigError
from core.hfconfig import text_model, text_model_weights
from core.hookspecs import hookimpl
from plugins.gemma import GEMMA2_WEIGHT_MAP, Gemma3TextConfig

# transformers' Gemma4TextConfig default when config.json has no rope_parameters
DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}


class Gemma4TextConfig(Gemma3TextConfig):
    """Gemma 4's text model. Defaults are transformers' Gemma4TextConfig's."""

    model_type: Literal["gemma4_text"] = "gemma4_text"
    vocab_size: PositiveInt = 262_144
    num_hidden_layers: PositiveInt = 30
    sliding_window: PositiveInt | None = 512
    # differs from gemma3: global layers have their own head_dim and (k_eq_v) kv heads
    global_head_dim: PositiveInt = 512
    num_global_key_value_heads: PositiveInt | None = None
    # what transformers 5 writes instead of the two keys above: {"<layer>": {"head_dim": ..,
    # "num_key_value_heads": ..}} for each global layer
    per_layer_config: dict[str, dict[str, Any]] | None = None
    attention_k_eq_v: bool = False
    num_kv_shared_layers: NonNegativeInt = 0
    use_double_wide_mlp: bool = False
    vocab_size_per_layer_input: PositiveInt = 262_144
    hidden_size_per_layer_input: NonNegativeInt | None = 256  # 0 / None: no per-layer inputs
    use_bidirectional_attention: Literal["all", "vision"] | None = None
    enable_moe_block: bool = False
    num_experts: PositiveInt | None = None
    top_k_experts: PositiveInt | None = None
    moe_intermediate_size: PositiveInt | None = None
    final_logit_softcapping: PositiveFloat | None = None

    def layer_kinds(self) -> list[str]:
        kinds = super().layer_kinds()
        if self.use_bidirectional_attention == "all":
            raise ConfigError(
                "config.json: field 'use_bidirectional_attention' is 'all' (an encoder); Zoo "
                "runs causal decoders: remove it or set it to null"
            )
        return [*kinds[:-1], "full_attention"]  # as transformers: the last layer is global

    def norm_spec(self) -> RMSNormSpec:
        return RMSNormSpec(self.rms_norm_eps, fp32_scale=True)  # differs: w, not (1 + w)

    def attention_spec(self) -> GQASpec:
        # differs from gemma3: scale 1 (q and k are normed), v normed too, no soft-cap
        return replace(
            super().attention_spec(), softmax_scale=1.0, softcap=None, v_norm=self.rms_norm_eps
        )

    def global_shape(self) -> tuple[int, int | None]:
        """The global layers' (head_dim, kv heads or None: num_key_value_heads)."""
        if self.per_layer_config is None:
            kv = self.num_global_key_value_heads if self.attention_k_eq_v else None
            return self.global_head_dim, kv
        kinds = self.layer_kinds()
        got = {
            tuple(sorted((self.per_layer_config.get(str(i)) or {}).items()))
            for i in range(self.num_hidden_layers)
            if kinds[i] == "full_attention"
        }
        local = [i for i, k in enumerate(kinds) if k != "full_attention"]
        if len(got) != 1 or any(self.per_layer_config.get(str(i)) for i in local):
            raise ConfigError(
                "config.json: field 'per_layer_config' gives window layers, or global layers "
                "unlike each other, their own shape; Gemma 4 has one shape per layer kind"
            )
        o = dict(got.pop())
        return o.get("head_dim", self.head_dim), o.get("num_key_value_heads")

    def _rope_block(self, kind: str) -> dict[str, Any]:
        return dict((self.rope_parameters or DEFAULT_ROPE).get(kind) or DEFAULT_ROPE[kind])

    def rope_spec(self) -> RopeSpec:
        """The global layers' rope, over global_head_dim."""
        p, d = self._rope_block("full_attention"), self.global_shape()[0]
        kind, theta = p.get("rope_type", "default"), float(p.get("rope_theta", 1_000_000.0))
        if p.get("factor", 1.0) != 1.0 or kind not in ("default", "proportional"):
            raise ConfigError(
                "config.json: field 'rope_parameters.full_attention' asks for rope_type "
                f"{kind!r} with factor {p.get('factor', 1.0)}; Gemma 4 runs 'proportional' or "
                "'default' without a factor"
            )
        if kind == "default":
            return DefaultRope(theta=theta, dim=d)
        rotated = int(float(p.get("partial_rotary_factor", 1.0)) * d // 2)
        return ProportionalRope(theta=theta, dim=d, rotated=rotated)

    def local_rope(self) -> RopeSpec:
        p = self._rope_block("sliding_attention")
        if p.get("rope_type", "default") != "default":
            raise ConfigError(
                "config.json: field 'rope_parameters.sliding_attention.rope_type' is "
                f"{p['rope_type']!r}; Gemma 4's window layers use plain rope ('default')"
            )
        return DefaultRope(theta=float(p.get("rope_theta", 10_000.0)), dim=self.head_dim)

    def kv_sources(self) -> list[int | None]:
        """Per layer, the earlier layer whose K/V it attends over (None: its own): the last
        `num_kv_shared_layers` layers read the last layer of their kind before them."""
        kinds, n = self.layer_kinds(), self.num_hidden_layers
        first = n - self.num_kv_shared_layers
        sources: list[int | None] = [None] * n
        for i in range(first, n):
            own = [j for j in range(first) if kinds[j] == kinds[i]]
            if not own:
                raise ConfigError(
                    f"config.json: field 'num_kv_shared_layers' ({self.num_kv_shared_layers}) "
                    f"leaves no earlier {kinds[i]} layer for layer {i} to share keys and "
                    "values with; lower it"
                )
            sources[i] = own[-1]
        return sources

    def attention_layers(self, base: Any) -> tuple[Any, ...]:
        local = self.local_rope()
        head_dim, kv_heads = self.global_shape()
        wide = replace(
            base,
            head_dim=head_dim,
            num_kv_heads=kv_heads or base.num_kv_heads,
            k_eq_v=self.attention_k_eq_v,
        )
        specs = []
        for kind, source in zip(self.layer_kinds(), self.kv_sources(), strict=True):
            spec = replace(base, window=self.sliding_window, rope=local)
            if kind == "full_attention":
                spec = wide
            specs.append(replace(spec, kv_source=source))
        return tuple(specs)

    def mlp_layers(self) -> tuple[DenseMLPSpec | DenseMoESpec, ...]:
        """Double-wide MLPs on the layers that share K/V, if use_double_wide_mlp; with
        enable_moe_block, routed experts beside each layer's MLP."""
        base = self.mlp_spec()
        double = replace(base, intermediate_size=2 * base.intermediate_size)
        dense = [
            double if self.use_double_wide_mlp and source is not None else base
            for source in self.kv_sources()
        ]
        if not self.enable_moe_block:
            return tuple(dense)
        moe = self.experts_spec()
        return tuple(DenseMoESpec(d, moe, self.norm_spec()) for d in dense)

    def experts_spec(self) -> MoESpec:
        """The routed experts of enable_moe_block: softmax top-k renormalised, GeGLU."""
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if getattr(self, key) is None:
                raise ConfigError(
                    f"config.json: field 'enable_moe_block' is true but '{key}' is not set; "
                    "set it (or set enable_moe_block to false)"
                )
        e, k = self.num_experts, self.top_k_experts
        if k > e:
            raise ConfigError(
                f"config.json: field 'top_k_experts' ({k}) exceeds num_experts ({e}); set it "
                f"between 1 and {e}"
            )
        return MoESpec(
            num_experts=e,
            top_k=k,
            intermediate_size=self.moe_intermediate_size,
            num_shared_experts=0,
            layers=tuple(range(self.num_hidden_layers)),
            norm_topk_prob=True,
            act="gelu_tanh",
        )

    def per_layer_input(self) -> PerLayerInputSpec | None:
        if not self.hidden_size_per_layer_input:
            return None
        return PerLayerInputSpec(
            self.hidden_size_per_layer_input, self.vocab_size_per_layer_input, self.norm_spec()
        )

    def to_runtime(self) -> RuntimeConfig:
        return replace(
            super().to_runtime(),
            mlp_layers=self.mlp_layers(),
            per_layer_input=self.per_layer_input(),
            layer_scalar=True,
        )


class Gemma4Config(Gemma4TextConfig):
    """A multimodal Gemma 4 (`gemma4`): its `text_config` is the text model Zoo runs; the vision
    and audio towers and their embedders are skipped at load (GEMMA4_WEIGHT_MAP)."""

    model_type: Literal["gemma4"] = "gemma4"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> Gemma4Config:
        return super().from_dict(text_model(raw, source, "gemma4"), source)


# differs from gemma3: the per-layer embeddings' tables and each block's use of them; the MoE
# models' router, stacked experts and extra norms, kept by the core inside the layer's `mlp`
_L = "model.layers.{}"
WEIGHT_MAP = {
    **GEMMA2_WEIGHT_MAP,
    f"{_L}.router": f"{_L}.mlp.router",
    f"{_L}.router.proj": f"{_L}.mlp.router.proj",
    f"{_L}.experts.gate_up_proj": f"{_L}.mlp.experts.gate_up_proj.weight",
    f"{_L}.experts.down_proj": f"{_L}.mlp.experts.down_proj.weight",
    f"{_L}.post_feedforward_layernorm_1": f"{_L}.mlp.post_norm_1",
    f"{_L}.pre_feedforward_layernorm_2": f"{_L}.mlp.pre_norm_2",
    f"{_L}.post_feedforward_layernorm_2": f"{_L}.mlp.post_norm_2",
    "model.embed_tokens_per_layer": "model.per_layer_embed.embed_tokens_per_layer",
    "model.per_layer_model_projection": "model.per_layer_embed.per_layer_model_projection",
    "model.per_layer_projection_norm": "model.per_layer_embed.per_layer_projection_norm",
    "model.layers.{}.per_layer_input_gate": "model.layers.{}.per_layer_input.gate",
    "model.layers.{}.per_layer_projection": "model.layers.{}.per_layer_input.proj",
    "model.layers.{}.post_per_layer_input_norm": "model.layers.{}.per_layer_input.norm",
}

# a gemma4 checkpoint's text model (model.language_model.*); towers and embedders not run
GEMMA4_WEIGHT_MAP = text_model_weights(
    WEIGHT_MAP, ("vision_tower", "audio_tower", "embed_vision", "embed_audio")
)


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture("gemma4_text", Gemma4TextConfig, WEIGHT_MAP)
    registry.add_architecture("gemma4", Gemma4Config, GEMMA4_WEIGHT_MAP)
