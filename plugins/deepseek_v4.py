"""DeepSeek V4 (model_type `deepseek_v4`: V4-Flash, V4-Pro), as a delta of DeepSeek V3.

Differs from V3: the residual is `hc_mult` hyper-connected streams (core/layers/hyper.py);
attention is shared-key=value MQA over a sliding window plus, per layer, compressed entries
(CSA: rate 4 with a lightning indexer; HCA: rate 128) (core/layers/compressed.py); the MoE
scores with sqrt(softplus), clamps its SwiGLU, and routes its first layers by token id
(core/layers/hash_moe.py). This file reads config.json (the hub's legacy keys included:
`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, a flat `rope_scaling`) and maps the
hub's checkpoint names (`layers.N.attn.wq_a`, `layers.N.ffn.experts.E.w1`, `hc_head_fn`...).
"""

from dataclasses import replace
from typing import Any, Literal

from pydantic import NonNegativeInt, PositiveFloat, PositiveInt, ValidationError

from core.config import MoESpec, RMSNormSpec, RopeSpec, RuntimeConfig
from core.config_kinds import CompressedAttentionSpec, HyperConnectionSpec
from core.errors import ConfigError
from core.hfconfig import DecoderConfig, validation_error
from core.hfrope import ROPE_KINDS
from core.hookspecs import hookimpl
from plugins.deepseek import STACKED_EXPERTS

KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
RATIO_KIND = {0: KINDS[0], 4: KINDS[1], 128: KINDS[2]}  # legacy `compress_ratios` values


class DeepseekV4Config(DecoderConfig):
    """Defaults are transformers' DeepseekV4Config's (V4-Flash's shape)."""

    model_type: Literal["deepseek_v4"] = "deepseek_v4"
    vocab_size: PositiveInt = 129280
    hidden_size: PositiveInt = 4096
    num_hidden_layers: PositiveInt = 43
    num_attention_heads: PositiveInt = 64
    num_key_value_heads: Literal[1] = 1  # one key=value head shared by all query heads
    head_dim: PositiveInt = 512
    intermediate_size: PositiveInt | None = None  # differs from V3: no dense MLP
    max_position_embeddings: PositiveInt = 1048576
    bos_token_id: NonNegativeInt | None = 0
    eos_token_id: NonNegativeInt | list[NonNegativeInt] | None = 1
    q_lora_rank: PositiveInt = 1024
    qk_rope_head_dim: PositiveInt | None = None  # legacy; else partial_rotary_factor
    partial_rotary_factor: PositiveFloat | None = None  # None: 64 / 512
    o_groups: PositiveInt = 8
    o_lora_rank: PositiveInt = 1024
    sliding_window: PositiveInt = 128
    # per-layer attention kinds: layer_types, or the legacy per-layer compress_ratios
    compress_ratios: list[NonNegativeInt] | None = None
    compress_rates: dict[str, PositiveInt] | None = None
    compress_rate_csa: PositiveInt | None = None  # legacy scalar overrides of compress_rates
    compress_rate_hca: PositiveInt | None = None
    compress_rope_theta: PositiveFloat = 160000.0
    index_n_heads: PositiveInt = 64
    index_head_dim: PositiveInt = 128
    index_topk: PositiveInt = 512
    hc_mult: PositiveInt = 4
    hc_sinkhorn_iters: PositiveInt = 20
    hc_eps: PositiveFloat = 1e-6
    # MoE on every layer; the first num_hash_layers (or mlp_layer_types' hash_moe) hash-routed
    n_routed_experts: PositiveInt = 256
    n_shared_experts: Literal[1] = 1
    num_experts_per_tok: PositiveInt = 6
    moe_intermediate_size: PositiveInt = 2048
    scoring_func: Literal["sqrtsoftplus"] = "sqrtsoftplus"
    topk_method: Literal["noaux_tc"] = "noaux_tc"  # the hub's key; the only V4 routing
    routed_scaling_factor: PositiveFloat = 1.5
    swiglu_limit: PositiveFloat = 10.0
    mlp_layer_types: list[str] | None = None
    num_hash_layers: NonNegativeInt | None = None  # legacy; default 3
    num_nextn_predict_layers: NonNegativeInt = 1  # MTP layers in the checkpoint: not loaded

    def layer_kinds(self) -> list[str]:
        n = self.num_hidden_layers
        if self.layer_types is not None:
            kinds = list(self.layer_types)
        elif self.compress_ratios is not None:  # the hub's V4 configs (one more: the MTP's)
            bad = sorted({r for r in self.compress_ratios if r not in RATIO_KIND})
            if bad:
                raise ConfigError(
                    f"config.json: field 'compress_ratios' holds {bad}; DeepSeek V4 knows "
                    f"{sorted(RATIO_KIND)} (sliding, CSA, HCA)"
                )
            kinds = [RATIO_KIND[r] for r in self.compress_ratios]
        else:  # transformers' default: 2 HCA, then CSA / HCA alternating
            kinds = [KINDS[2]] * min(n, 2) + [KINDS[1] if i % 2 else KINDS[2] for i in range(n - 2)]
        bad = sorted({k for k in kinds[:n] if k not in KINDS})
        if len(kinds) < n or bad:
            raise ConfigError(
                f"config.json: field 'layer_types' must give one of {', '.join(KINDS)} for each "
                f"of the {n} layers; got {len(kinds)} kinds"
                + (f", {bad} among them" if bad else "")
            )
        return kinds[:n]

    def compress_rate(self, kind: str) -> int:
        rates = {KINDS[1]: 4, KINDS[2]: 128, **(self.compress_rates or {})}
        legacy = {KINDS[1]: self.compress_rate_csa, KINDS[2]: self.compress_rate_hca}
        return 0 if kind == KINDS[0] else legacy[kind] or rates[kind]

    def rope_dim(self) -> int:
        if self.qk_rope_head_dim is None:
            return self.partial_rope_dim(self.partial_rotary_factor or 64 / 512)
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise ConfigError(
                f"config.json: field 'qk_rope_head_dim' ({self.qk_rope_head_dim}) must be even "
                f"and at most head_dim ({self.head_dim})"
            )
        return self.qk_rope_head_dim

    def rope_blocks(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(main, compress) rope parameters: transformers 5 nests them under those names; the
        hub's flat rope_scaling (YaRN) is the compress rope's, the main one is plain."""
        params = dict(self.rope_parameters or self.rope_scaling or {})
        if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
            return dict(params["main"]), dict(params["compress"])
        main = {"rope_type": "default", "rope_theta": self.rope_theta or 10000.0}
        compress = {**params, "rope_theta": self.compress_rope_theta}
        if compress.get("rope_type", compress.get("type")) == "yarn":
            compress.setdefault("attention_factor", 1.0)  # V4 does not scale cos / sin
        return main, compress

    def rope_of(self, block: dict[str, Any], name: str) -> RopeSpec:
        block = dict(block)
        kind = block.pop("rope_type", None) or block.pop("type", None) or "default"
        theta = block.pop("rope_theta", None) or self.default_rope_theta
        where = "rope_parameters" if self.rope_parameters else "rope_scaling"
        if kind not in ("default", "yarn") or not isinstance(theta, int | float) or theta <= 0:
            raise ConfigError(
                f"config.json: field '{where}' gives the {name} rope rope_type {kind!r}, "
                f"rope_theta {theta!r}; DeepSeek V4 uses default or yarn, a positive theta"
            )
        try:  # V4 rotates (x0, x1) pairs, as V2 / V3 do
            spec = ROPE_KINDS[kind](block, float(theta), self.rope_dim(), self)
            return replace(spec, interleaved=True)
        except ValidationError as err:
            raise validation_error(err, f"config.json {where} ({name} rope, {kind})") from None

    def rope_spec(self) -> RopeSpec:
        return self.rope_of(self.rope_blocks()[0], "main")

    def attention_layers(self, base: Any) -> tuple[Any, ...]:
        if self.num_attention_heads * self.head_dim % self.o_groups:
            raise ConfigError(
                f"config.json: field 'o_groups' ({self.o_groups}) must divide "
                f"num_attention_heads x head_dim ({self.num_attention_heads * self.head_dim})"
            )
        compress = self.rope_of(self.rope_blocks()[1], "compress")
        specs = []
        for kind in self.layer_kinds():
            rate = self.compress_rate(kind)
            index = kind == KINDS[1]
            specs.append(
                CompressedAttentionSpec(
                    num_heads=self.num_attention_heads,
                    head_dim=self.head_dim,
                    q_lora_rank=self.q_lora_rank,
                    rope_dim=self.rope_dim(),
                    o_groups=self.o_groups,
                    o_lora_rank=self.o_lora_rank,
                    sliding_window=self.sliding_window,
                    norm_eps=self.rms_norm_eps,
                    rope=self.rope_spec() if rate == 0 else compress,
                    compress_rate=rate,
                    index_heads=self.index_n_heads if index else 0,
                    index_head_dim=self.index_head_dim if index else 0,
                    index_topk=self.index_topk if index else 0,
                )
            )
        return tuple(specs)

    def attention_spec(self) -> CompressedAttentionSpec:
        return self.attention_layers(None)[0]  # the model's "attention": layer 0's kind

    def hash_layers(self) -> tuple[int, ...]:
        n = self.num_hidden_layers
        if self.mlp_layer_types is not None:
            kinds = self.mlp_layer_types[:n]
            bad = sorted({k for k in kinds if k not in ("hash_moe", "moe")})
            if len(kinds) < n or bad:
                raise ConfigError(
                    "config.json: field 'mlp_layer_types' must give hash_moe or moe for each of "
                    f"the {n} layers; got {len(kinds)} kinds"
                    + (f", {bad} among them" if bad else "")
                )
            return tuple(i for i, k in enumerate(kinds) if k == "hash_moe")
        hashed = 3 if self.num_hash_layers is None else self.num_hash_layers
        return tuple(range(min(n, hashed)))

    def moe_spec(self) -> MoESpec:
        return MoESpec(
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size,
            num_shared_experts=1,
            layers=tuple(range(self.num_hidden_layers)),
            scoring="sqrtsoftplus",
            topk_method="noaux_tc",  # one group: top-k of score + e_score_correction_bias
            norm_topk_prob=True,  # transformers renormalises whatever norm_topk_prob says
            routed_scaling_factor=self.routed_scaling_factor,
            swiglu_limit=self.swiglu_limit,
            hash_layers=self.hash_layers(),
        )

    def mlp_spec(self) -> Any:
        return self.moe_spec().shared  # never built: every layer is MoE

    def norm_spec(self) -> RMSNormSpec:
        return RMSNormSpec(self.rms_norm_eps, fp32_weight=True)  # differs: fp32 weights

    def mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    def to_runtime(self) -> RuntimeConfig:
        hc = HyperConnectionSpec(
            self.hc_mult, self.hc_sinkhorn_iters, self.hc_eps, norm_eps=self.rms_norm_eps
        )
        return replace(super().to_runtime(), hyper_connections=hc)


_L = "model.layers.{}"
# The hub's names (DeepSeek's own: no `model.` prefix) -> the core's. transformers'
# save_pretrained writes most of them back with a `model.` prefix, so both spellings map;
# transformers' in-memory names are the core's own (identity), but for the fused shared experts.
HUB = {
    "embed": "model.embed_tokens",
    "head": "lm_head",
    "norm": "model.norm",
    "hc_head_fn": "model.hc_head.hc_fn",  # whole tensors (no .weight leaf)
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    "layers.{}.attn_norm": f"{_L}.input_layernorm",
    "layers.{}.ffn_norm": f"{_L}.post_attention_layernorm",
    **{
        f"layers.{{}}.hc_{part}_{name}": f"{_L}.{part}_hc.{name}"
        for part in ("attn", "ffn")
        for name in ("fn", "base", "scale")
    },
    "layers.{}.attn.attn_sink": f"{_L}.self_attn.sinks",
    "layers.{}.attn.wq_a": f"{_L}.self_attn.q_a_proj",
    "layers.{}.attn.q_norm": f"{_L}.self_attn.q_a_norm",
    "layers.{}.attn.wq_b": f"{_L}.self_attn.q_b_proj",
    "layers.{}.attn.wkv": f"{_L}.self_attn.kv_proj",
    "layers.{}.attn.kv_norm": f"{_L}.self_attn.kv_norm",
    "layers.{}.attn.norm": f"{_L}.self_attn.kv_norm",  # as transformers writes it back
    "layers.{}.attn.wo_a": f"{_L}.self_attn.o_a_proj",
    "layers.{}.attn.wo_b": f"{_L}.self_attn.o_b_proj",
    **{
        f"layers.{{}}.attn.{hub}.{name}": f"{_L}.self_attn.{core}.{ours}"
        for hub, core in (
            ("compressor", "compressor"),
            ("indexer.compressor", "compressor.indexer"),
        )
        for name, ours in (("wkv", "kv_proj"), ("wgate", "gate_proj"), ("norm", "kv_norm"))
    },
    "layers.{}.attn.compressor.ape": f"{_L}.self_attn.compressor.position_bias",
    "layers.{}.attn.indexer.compressor.ape": f"{_L}.self_attn.compressor.indexer.position_bias",
    "layers.{}.attn.indexer.wq_b": f"{_L}.self_attn.compressor.indexer.q_b_proj",
    "layers.{}.attn.indexer.weights_proj": f"{_L}.self_attn.compressor.indexer.scorer.weights_proj",
    "layers.{}.ffn.gate": f"{_L}.mlp.gate",
    "layers.{}.ffn.gate.bias": f"{_L}.mlp.gate.e_score_correction_bias",
    "layers.{}.ffn.gate.tid2eid": f"{_L}.mlp.gate.tid2eid",
    "layers.{}.ffn.experts.{}.w1": (f"{_L}.mlp.experts.gate_up_proj", "{}.gate"),
    "layers.{}.ffn.experts.{}.w3": (f"{_L}.mlp.experts.gate_up_proj", "{}.up"),
    "layers.{}.ffn.experts.{}.w2": (f"{_L}.mlp.experts.down_proj", "{}"),
    "layers.{}.ffn.shared_experts.w1": (f"{_L}.mlp.shared_experts.gate_up_proj", "gate"),
    "layers.{}.ffn.shared_experts.w3": (f"{_L}.mlp.shared_experts.gate_up_proj", "up"),
    "layers.{}.ffn.shared_experts.w2": f"{_L}.mlp.shared_experts.down_proj",
}
WEIGHT_MAP = {
    **HUB,
    "mtp.*": None,  # the multi-token-prediction layers (mtp.0....): not run
    **{f"model.{k}": v for k, v in HUB.items()},
    f"{_L}.mlp.shared_experts.gate_proj": (f"{_L}.mlp.shared_experts.gate_up_proj", "gate"),
    f"{_L}.mlp.shared_experts.up_proj": (f"{_L}.mlp.shared_experts.gate_up_proj", "up"),
    **STACKED_EXPERTS,
}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture(("deepseek_v4",), DeepseekV4Config, WEIGHT_MAP)
