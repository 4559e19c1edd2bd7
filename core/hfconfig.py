"""Hub `config.json` -> `RuntimeConfig`, through pydantic DTOs.

`DecoderConfig` reads the keys every Llama-family config on the hub uses, in all the spellings
seen in the wild (`rope_scaling` with `type` or `rope_type`, transformers-5 `rope_parameters`,
`torch_dtype` or `dtype`, ...). Architecture plugins subclass it and override what differs.
Unknown keys are ignored; invalid ones raise `ConfigError` naming the field.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveFloat, PositiveInt
from pydantic import ValidationError as _ValidationError

from core.config import (
    DenseMLPSpec,
    EmbeddingSpec,
    GQASpec,
    MoESpec,
    RMSNormSpec,
    RopeSpec,
    RuntimeConfig,
)
from core.config_kinds import MTPSpec
from core.errors import ConfigError
from core.hfrope import ROPE_KINDS

DTYPES = ("float32", "float16", "bfloat16")
LAYER_KINDS = ("full_attention", "sliding_attention")  # the `layer_types` values Zoo runs


def validation_error(err: _ValidationError, source: str) -> ConfigError:
    """Turn pydantic's report into one line that names every bad field."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(root)"
        if e["type"] == "missing":
            parts.append(f"missing required field '{loc}'")
        else:
            parts.append(f"field '{loc}': {e['msg']} (got {e.get('input')!r})")
    return ConfigError(f"{source}: " + "; ".join(parts))


def routed_top_k(k: int, experts: int, experts_field: str) -> int:
    """num_experts_per_tok, checked against the layer's expert count (`experts_field` names the
    config key that holds it): a ConfigError naming both where a token would need more."""
    if k > experts:
        raise ConfigError(
            f"config.json: field 'num_experts_per_tok' ({k}) exceeds {experts_field} "
            f"({experts}): a token cannot be routed to more experts than the layer has; set it "
            f"between 1 and {experts}"
        )
    return k


def text_model(raw: Any, source: str, model_type: str) -> dict[str, Any]:
    """A multimodal config's text model (gemma3, qwen3_5): its `text_config`, with the top
    level's dtype and tying (transformers reads them there) and its token ids where the text
    model has none, as a `model_type` config."""
    text = raw.get("text_config") if isinstance(raw, dict) else None
    if not isinstance(text, dict):
        raise ConfigError(
            f"{source}: field 'text_config' is missing or not an object; a {model_type} config "
            "describes its text model there"
        )
    top = {k: raw[k] for k in ("dtype", "torch_dtype", "tie_word_embeddings") if k in raw}
    gaps = {k: raw[k] for k in ("bos_token_id", "eos_token_id") if k in raw}
    return {**gaps, **text, **top, "model_type": model_type}


def text_model_weights(base: dict[str, Any], towers: tuple[str, ...]) -> dict[str, Any]:
    """A multimodal checkpoint's weight map: the text model's (`base`) under the hub's names
    (language_model.model.*, language_model.lm_head.*) and transformers 5's
    (model.language_model.*); the other parts (`towers`: vision_tower, multi_modal_projector,
    ...), at the top level or under model., are not loaded."""
    skipped = {f"{where}{tower}.*": None for tower in towers for where in ("", "model.")}
    return {
        **base,
        "language_model.model.*": "model.*",
        "language_model.lm_head.*": "lm_head.*",
        "model.language_model.*": "model.*",
        **skipped,
    }


def json_floats(v: Any) -> Any:
    """A list of floats as transformers 5 writes it: inf as {"__float__": "Infinity"} (JSON
    has no inf), e.g. Mamba2's time_step_limit; anything else as it is."""
    if isinstance(v, list | tuple):
        return [float(x["__float__"]) if isinstance(x, dict) and "__float__" in x else x
                for x in v]  # fmt: skip
    return v


def every_layer_moe(cfg: DecoderConfig, experts_field: str, width: int, **extra: Any) -> MoESpec:
    """Routed experts on every layer, no shared ones, softmax top-k renormalised (Mixtral's
    MoE; `extra`: the MoESpec fields a family adds): `experts_field` names the config key that
    holds the expert count, `width` is each expert's; cfg.num_experts_per_tok route a token."""
    e = getattr(cfg, experts_field)
    return MoESpec(
        num_experts=e,
        top_k=routed_top_k(cfg.num_experts_per_tok, e, experts_field),
        intermediate_size=width,
        num_shared_experts=0,
        layers=tuple(range(cfg.num_hidden_layers)),
        scoring="softmax",
        topk_method="greedy",
        norm_topk_prob=True,
        **extra,
    )


class DecoderConfig(BaseModel):
    """A Llama-style decoder's config.json. Subclasses narrow `model_type` and add their keys."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model_type: str
    vocab_size: PositiveInt
    hidden_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt | None = None  # absent: multi-head attention
    head_dim: PositiveInt | None = None  # absent: hidden_size // num_attention_heads
    intermediate_size: PositiveInt
    hidden_act: Literal["silu"] = "silu"
    rms_norm_eps: PositiveFloat = 1e-6
    max_position_embeddings: PositiveInt = 2048
    rope_theta: PositiveFloat | None = None
    rope_scaling: dict[str, Any] | None = None  # transformers 4 style
    rope_parameters: dict[str, Any] | None = None  # transformers 5 style (holds rope_theta too)
    torch_dtype: str | None = None  # transformers 4 style
    dtype: str | None = None  # transformers 5 style
    bos_token_id: NonNegativeInt | None = None
    eos_token_id: NonNegativeInt | list[NonNegativeInt] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # per-layer attention kinds (transformers 5 writes them out): full_attention, or
    # sliding_attention within `sliding_window` tokens; see layer_windows()
    layer_types: list[str] | None = None
    sliding_window: PositiveInt | None = None

    default_rope_theta: ClassVar[float] = (
        10000.0  # what transformers assumes when the key is absent
    )
    # the `layer_types` values this family runs (a hybrid's own kinds beside attention's)
    layer_kind_names: ClassVar[tuple[str, ...]] = LAYER_KINDS

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> DecoderConfig:
        """Validate a raw config dict; errors become one `ConfigError` naming every bad field."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        try:
            return cls.model_validate(raw)
        except _ValidationError as err:
            raise validation_error(err, source) from None

    # --- derivations: each a small method a subclass may override -----------------------------
    def resolved_head_dim(self) -> int:
        if self.head_dim is not None:
            return self.head_dim
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"config.json: hidden_size ({self.hidden_size}) is not divisible by "
                f"num_attention_heads ({self.num_attention_heads}); set head_dim explicitly"
            )
        return self.hidden_size // self.num_attention_heads

    def attention_spec(self) -> GQASpec:
        kv = self.num_key_value_heads or self.num_attention_heads
        if self.num_attention_heads % kv:
            raise ConfigError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) is not a multiple "
                f"of num_key_value_heads ({kv})"
            )
        return GQASpec(
            num_heads=self.num_attention_heads,
            num_kv_heads=kv,
            head_dim=self.resolved_head_dim(),
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
        )

    # --- per-layer attention: each a small method a subclass may override --------------------
    def layer_kinds(self) -> list[str]:
        """Each layer's kind, from `layer_types` (checked against LAYER_KINDS) or, absent,
        `default_layer_kinds()`."""
        n = self.num_hidden_layers
        kinds = self.layer_types if self.layer_types is not None else self.default_layer_kinds()
        if len(kinds) < n:
            raise ConfigError(
                f"config.json: field 'layer_types' lists {len(kinds)} kinds for "
                f"num_hidden_layers={n}; give one per layer"
            )
        bad = sorted({k for k in kinds[:n] if k not in self.layer_kind_names})
        if bad:
            raise ConfigError(
                f"config.json: field 'layer_types' holds {', '.join(map(repr, bad))}, which "
                f"{type(self).__name__} cannot run; supported: {', '.join(self.layer_kind_names)}"
            )
        return list(kinds[:n])

    def default_layer_kinds(self) -> list[str]:
        """Layer kinds when config.json has no `layer_types`: all full (Llama)."""
        return ["full_attention"] * self.num_hidden_layers

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention)."""
        kinds = self.layer_kinds()
        sliding = [i for i, k in enumerate(kinds) if k == "sliding_attention"]
        if sliding and self.sliding_window is None:
            raise ConfigError(
                f"config.json: layers {sliding} are sliding_attention (field 'layer_types'), "
                "but field 'sliding_window' is not set; set it to the window in tokens"
            )
        return [self.sliding_window if k == "sliding_attention" else None for k in kinds]

    def layer_ropes(self) -> list[bool]:
        """Whether each layer rotates q and k (False: a NoPE layer)."""
        return [True] * self.num_hidden_layers

    def attention_layers(self, base: Any) -> tuple[Any, ...]:
        """Every layer's attention spec: `base` with that layer's window and rope."""
        specs = []
        for i, (window, roped) in enumerate(
            zip(self.layer_windows(), self.layer_ropes(), strict=True)
        ):
            if window is None and roped:
                specs.append(base)
            elif not isinstance(base, GQASpec):  # MLA has no window nor NoPE form
                what = f"a sliding window of {window}" if window is not None else "no rope"
                raise ConfigError(
                    f"config.json: layer {i} asks for {what} (fields 'layer_types', "
                    f"'sliding_window', 'no_rope_layers'), which {type(base).__name__} "
                    "attention cannot run; remove those keys"
                )
            else:
                specs.append(replace(base, window=window, rope="model" if roped else "none"))
        return tuple(specs)

    def mlp_spec(self) -> DenseMLPSpec:
        return DenseMLPSpec(self.intermediate_size, bias=self.mlp_bias, act=self.hidden_act)

    def norm_spec(self) -> RMSNormSpec:
        return RMSNormSpec(self.rms_norm_eps)

    def embedding_spec(self) -> EmbeddingSpec:
        return EmbeddingSpec()

    def rope_dim(self) -> int:
        return self.resolved_head_dim()

    def partial_rope_dim(self, factor: float | None) -> int:
        """Rope on the first int(head_dim * partial_rotary_factor) dims of each head, as
        transformers: the factor in the rope parameters (transformers 5) wins over `factor`,
        the top-level key (None: 1). For the families that rotate part of each head."""
        _, params = DecoderConfig.rope_params(self)  # the hub's block, before a family's edits
        f = float(params.get("partial_rotary_factor") or factor or 1.0)
        dim = int(self.resolved_head_dim() * f)
        if dim < 2 or dim % 2:
            raise ConfigError(
                f"config.json: field 'partial_rotary_factor' ({f}) gives {dim} rotary dims per "
                f"head (head_dim {self.resolved_head_dim()}); it needs an even number of at "
                "least 2"
            )
        return dim

    def rope_params(self) -> tuple[str, dict[str, Any]]:
        """(rope kind, its parameters) from `rope_parameters` or `rope_scaling`, any key style."""
        params = dict(self.rope_parameters or self.rope_scaling or {})
        rope_type, legacy = params.pop("rope_type", None), params.pop("type", None)
        return rope_type or legacy or "default", params

    def rope_spec(self) -> RopeSpec:
        kind, params = self.rope_params()
        where = "rope_parameters" if self.rope_parameters else "rope_scaling"
        theta = params.pop("rope_theta", None) or self.rope_theta or self.default_rope_theta
        if not isinstance(theta, int | float) or theta <= 0:
            raise ConfigError(
                f"config.json: field 'rope_theta' must be a positive number: {theta!r}"
            )
        build = ROPE_KINDS.get(kind)
        if build is None:
            raise ConfigError(
                f"config.json: unknown {where}.rope_type {kind!r}; supported: "
                + ", ".join(sorted(ROPE_KINDS))
            )
        try:
            return build(params, float(theta), self.rope_dim(), self)
        except _ValidationError as err:
            raise validation_error(err, f"config.json {where} ({kind})") from None

    def moe_spec(self) -> MoESpec | None:
        """The routed-experts MLP and the layers it replaces the dense MLP on; None: dense."""
        return None

    def adapt_weight_map(self, base: dict[str, Any]) -> dict[str, Any]:
        """The weight map for checkpoints of this config: the architecture's `base`, or a copy
        where a family's names depend on a config key (Granite 4.0-H's shared MLP is the
        core's MoE shared expert, or the dense MLP of a model without experts)."""
        return base

    def weight_scales(self) -> dict[str, Any]:
        """Checkpoint tensors (integers as "{}") multiplied by a constant as they load: a
        float, or (rows, factor) segments along the first dim (Falcon-H1's multipliers, folded
        into the weights they follow); none by default."""
        return {}

    def logits_scale(self) -> float:
        """What the LM head's logits are multiplied by (1: as they come)."""
        return 1.0

    def final_softcap(self) -> float | None:
        """The soft-cap on the LM head's logits (None: none)."""
        return None

    def post_norms(self) -> bool:
        """Whether each sub-block's output is normed before its residual add."""
        return False

    def pre_norms(self) -> bool:
        """Whether each sub-block's input is normed (False: OLMo 2 / 3, post-norms only)."""
        return True

    def mtp_layers(self) -> int:
        """Extra checkpoint layers past num_hidden_layers that the model does not run."""
        return 0

    def mtp_spec(self) -> MTPSpec | None:
        """The first of those as speculative decoding runs it (core/mtp.py); None: none, or not
        of a kind the core runs."""
        return None

    def runtime_dtype(self) -> str:
        name = (self.dtype or self.torch_dtype or "float32").removeprefix("torch.")
        if name not in DTYPES:
            raise ConfigError(
                f"config.json: field 'torch_dtype' {name!r} is not one of {', '.join(DTYPES)}"
            )
        return name

    def eos_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)

    def to_runtime(self) -> RuntimeConfig:
        """The frozen config the core builds from; every derivation and check happens here."""
        attention = self.attention_spec()
        return RuntimeConfig(
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_hidden_layers,
            attention=attention,
            attention_layers=self.attention_layers(attention),
            mlp=self.mlp_spec(),
            rope=self.rope_spec(),
            norm=self.norm_spec(),
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            dtype=self.runtime_dtype(),
            bos_token_id=self.bos_token_id,
            eos_token_ids=self.eos_ids(),
            moe=self.moe_spec(),
            embedding=self.embedding_spec(),
            mtp_layers=self.mtp_layers(),
            mtp=self.mtp_spec(),
            logits_scale=self.logits_scale(),
            final_softcap=self.final_softcap(),
            post_norms=self.post_norms(),
            pre_norms=self.pre_norms(),
        )
