"""DeepSeek V3.2 (model_type `deepseek_v32`: V3.2, V3.2-Exp, V3.2-Speciale) and GLM-5
(`glm_moe_dsa`), as a delta of DeepSeek V3: the same MLA and MoE, plus DeepSeek sparse attention
(DSA), a lightning indexer per layer that picks the top `index_topk` keys each query attends
to (core/layers/dsa.py). GLM-5 lets some layers reuse the previous indexer layer's selection.
Multi-token-prediction layers (num_nextn_predict_layers) are skipped at load, as in V3.
"""

from dataclasses import fields, replace
from typing import Any, Literal

from pydantic import NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from core.config_kinds import SparseMLASpec
from core.errors import ConfigError
from core.hookspecs import hookimpl
from plugins.deepseek import WEIGHT_MAP, DeepseekV3Config


class DeepseekV32Config(DeepseekV3Config):
    """Defaults are transformers' DeepseekV32Config's."""

    model_type: Literal["deepseek_v32"] = "deepseek_v32"
    # differs from v3: the lightning indexer of DeepSeek sparse attention
    index_topk: PositiveInt = 2048
    index_n_heads: PositiveInt = 64
    index_head_dim: PositiveInt = 128
    # transformers ignores this key and hard-codes each family's layout; we honour it if set
    indexer_rope_interleave: bool | None = None
    # differs from v3: MoE layers by kind ("dense" | "sparse"), else first_k_dense_replace on
    mlp_layer_types: list[Literal["dense", "sparse"]] | None = None
    # transformers 5 writes every layer's kind out: "indexed_attention" (later versions:
    # "deepseek_sparse_attention")
    layer_types: list[str] | None = None

    def rope_interleaved(self) -> bool:
        return True  # differs from v3: MLA's rope is always interleaved (no rope_interleave key)

    def mtp_spec(self) -> None:
        return None  # differs from v3: its MTP layer's sparse attention is not run (untested)

    def index_rope_interleaved(self) -> bool:
        default = False  # V3.2's indexer rotates half-split pairs, unlike its MLA
        return default if self.indexer_rope_interleave is None else self.indexer_rope_interleave

    def indexer_kinds(self) -> list[str]:
        """Per layer: "full" runs its own indexer, "shared" reuses the previous one's top-k."""
        return ["full"] * self.num_hidden_layers

    def moe_layers(self) -> tuple[int, ...]:
        kinds = self.mlp_layer_types
        if kinds is None:  # differs from v3: transformers reads no moe_layer_freq here
            return tuple(range(min(self.first_k_dense_replace, self.num_hidden_layers),
                               self.num_hidden_layers))  # fmt: skip
        if len(kinds) < self.num_hidden_layers:
            raise ConfigError(
                f"config.json: field 'mlp_layer_types' lists {len(kinds)} kinds for "
                f"num_hidden_layers={self.num_hidden_layers}; give one per layer"
            )
        return tuple(i for i, k in enumerate(kinds[: self.num_hidden_layers]) if k == "sparse")

    def attention_spec(self) -> SparseMLASpec:
        mla = super().attention_spec()
        if self.q_lora_rank is None:
            raise ConfigError(
                "config.json: field 'q_lora_rank' is null, but the DSA indexer projects its "
                "queries from q_a (wq_b); set q_lora_rank"
            )
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(
                f"config.json: field 'index_head_dim' ({self.index_head_dim}) is smaller than "
                f"qk_rope_head_dim ({self.qk_rope_head_dim}), the indexer's roped part"
            )
        return SparseMLASpec(
            **{f.name: getattr(mla, f.name) for f in fields(mla)},
            index_heads=self.index_n_heads,
            index_head_dim=self.index_head_dim,
            index_topk=self.index_topk,
            index_rope_interleaved=self.index_rope_interleaved(),
        )

    def attention_layers(self, base: Any) -> tuple[Any, ...]:
        n = self.num_hidden_layers
        kinds = set((self.layer_types or [])[:n])
        bad = sorted(kinds - {"indexed_attention", "deepseek_sparse_attention"})
        if bad:
            raise ConfigError(
                f"config.json: field 'layer_types' holds {', '.join(map(repr, bad))}; "
                f"{self.model_type} layers are all 'indexed_attention' (remove the key)"
            )
        kinds = self.indexer_kinds()
        if kinds and kinds[0] != "full":
            raise ConfigError(
                "config.json: layer 0 shares the top-k of an earlier indexer layer, and there "
                "is none (fields 'indexer_types' / 'index_topk_pattern'); make layer 0 'full'"
            )
        shared = replace(base, shared_selection=True)
        return tuple(base if k == "full" else shared for k in kinds)


class GlmMoeDsaConfig(DeepseekV32Config):
    """Defaults are transformers' GlmMoeDsaConfig's (GLM-5)."""

    model_type: Literal["glm_moe_dsa"] = "glm_moe_dsa"
    vocab_size: PositiveInt = 154880
    hidden_size: PositiveInt = 6144
    intermediate_size: PositiveInt = 12288
    num_hidden_layers: PositiveInt = 78
    num_attention_heads: PositiveInt = 64
    q_lora_rank: PositiveInt | None = 2048
    v_head_dim: PositiveInt = 256
    qk_nope_head_dim: PositiveInt = 192
    n_group: PositiveInt | None = 1
    topk_group: PositiveInt | None = 1
    max_position_embeddings: PositiveInt = 202752
    rms_norm_eps: PositiveFloat = 1e-5
    index_n_heads: PositiveInt = 32
    # differs from v3.2: layers may reuse the previous indexer layer's top-k. One of:
    # indexer_types ("full" | "shared" per layer), index_topk_pattern ("FSSF...", or a list),
    # else index_topk_freq / index_skip_topk_offset (layer i is full when
    # max(i - offset + 1, 0) % freq == 0)
    indexer_types: list[Literal["full", "shared"]] | None = None
    index_topk_pattern: str | list[Literal["full", "shared"]] | None = None
    index_topk_freq: int = 1
    index_skip_topk_offset: NonNegativeInt = 2

    @model_validator(mode="after")
    def _pattern_letters(self):
        if isinstance(self.index_topk_pattern, str) and set(self.index_topk_pattern) - {"F", "S"}:
            raise ValueError("index_topk_pattern: a string of 'F' (full) and 'S' (shared)")
        return self

    def index_rope_interleaved(self) -> bool:
        default = True  # differs from v3.2: the indexer's rope is interleaved, as MLA's
        return default if self.indexer_rope_interleave is None else self.indexer_rope_interleave

    def indexer_kinds(self) -> list[str]:
        n = self.num_hidden_layers
        kinds = self.indexer_types
        if kinds is None and self.index_topk_pattern is not None:
            pattern = self.index_topk_pattern
            kinds = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(
                pattern, str) else list(pattern)  # fmt: skip
        if kinds is None:
            freq, offset = max(self.index_topk_freq, 1), self.index_skip_topk_offset
            return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
        if len(kinds) < n:
            raise ConfigError(
                f"config.json: field 'indexer_types' (or 'index_topk_pattern') lists "
                f"{len(kinds)} layers for num_hidden_layers={n}; give one per layer"
            )
        return list(kinds[:n])


# DSA's indexer keeps its hub names (self_attn.indexer.*): the weight map is V3's, plus the
# MTP block of a GGUF file (llama.cpp's converters keep it; the GGUF reader names it mtp.*)
DSA_WEIGHT_MAP = {**WEIGHT_MAP, "mtp.*": None}


@hookimpl
def zoo_register_architectures(registry):
    registry.add_architecture(("deepseek_v32",), DeepseekV32Config, DSA_WEIGHT_MAP)
    registry.add_architecture(("glm_moe_dsa",), GlmMoeDsaConfig, DSA_WEIGHT_MAP)
