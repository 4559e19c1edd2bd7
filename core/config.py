"""The frozen runtime config: what the core builds a model from.

Plugins turn a hub `config.json` into these (see `core.hfconfig`); derivations and validation
happen there, once. Nothing in here imports torch, so listing and inspecting models stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Literal


# --- rotary position embeddings: one frozen spec per kind -------------------------------------
@dataclass(frozen=True)
class DefaultRope:
    """Plain RoPE: inv_freq = theta ** (-2i / dim)."""

    theta: float
    dim: int  # rotary dims per head (== head_dim unless partial rotary)
    interleaved: bool = False  # DeepSeek rotates (x0, x1) pairs; Llama rotates (x_i, x_{i+d/2})


@dataclass(frozen=True)
class LinearRope(DefaultRope):
    """Position interpolation: inv_freq / factor."""

    factor: float = 1.0


@dataclass(frozen=True)
class DynamicRope(DefaultRope):
    """Dynamic NTK: theta grows with the sequence length once it passes max_position_embeddings."""

    factor: float = 1.0
    max_position_embeddings: int = 2048


@dataclass(frozen=True)
class Llama3Rope(DefaultRope):
    """Llama 3.1's band-wise interpolation of the low frequencies."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, kw_only=True)
class YarnRope(DefaultRope):
    """YaRN: frequencies ramp from extrapolated to interpolated between the beta bounds.

    `attention_factor` multiplies cos and sin (so q.k by its square); it is derived once from
    factor / mscale / mscale_all_dim when the config does not give it. mscale and mscale_all_dim
    keep 0.0 for "not set", which transformers treats the same way.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float = 1.0
    truncate: bool = True  # round the correction range outward to whole dims


RopeSpec = DefaultRope  # every kind is a DefaultRope subclass


# --- layer kinds -----------------------------------------------------------------------------
# The core's generic block builds each module from the type of its spec: `core.plugins`'
# registry maps spec types to modules (the built-ins in plugins/core_layers.py; a plugin may
# add its own with `zoo_register_layers`).
@dataclass(frozen=True)
class EmbeddingSpec:
    """Token embedding; its output is multiplied by `scale` rounded to the model dtype
    (Gemma: sqrt(hidden_size)), as transformers does. 1.0: no scaling."""

    scale: float = 1.0


@dataclass(frozen=True)
class RMSNormSpec:
    """x / sqrt(mean(x^2) + eps) * weight, accumulated in fp32."""

    eps: float


@dataclass(frozen=True)
class GQASpec:
    """Grouped-query attention: num_heads query heads share num_kv_heads key/value heads."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def cache_layout(self, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
        """What one layer caches, in the order forward() takes it: full K and V per kv head."""
        shape = (batch, self.num_kv_heads, seq, self.head_dim)  # (B, H_kv, S, D)
        return {"k": shape, "v": shape}


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek V2/V3): K and V are decompressed per head from a
    shared latent (kv_lora_rank) plus one roped key part (qk_rope_head_dim) per token."""

    num_heads: int
    q_lora_rank: int | None  # None: a plain q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float  # the softmax scale, with YaRN's mscale correction already folded in
    bias: bool = False  # on q_a_proj, kv_a_proj_with_mqa and o_proj
    norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm (not rms_norm_eps)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def cache_layout(self, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
        """The compressed cache: the normed latent and the roped key part, shared by all heads."""
        return {
            "latent": (batch, seq, self.kv_lora_rank),
            "k_pe": (batch, seq, self.qk_rope_head_dim),
        }


AttentionSpec = GQASpec | MLASpec


@dataclass(frozen=True)
class DenseMLPSpec:
    """down(act(gate(x)) * up(x)); act is "silu" (SwiGLU)."""

    intermediate_size: int
    bias: bool = False
    act: str = "silu"


@dataclass(frozen=True)
class MoESpec:
    """Routed SwiGLU experts (+ optional always-on shared experts) on the listed layers.

    Routing: scores = softmax | sigmoid(router logits, fp32); pick top_k experts by
    - "greedy": the highest scores;
    - "group_limited_greedy": only within the topk_groups groups with the highest max score;
    - "noaux_tc": by score + e_score_correction_bias, within the topk_groups groups with the
      highest sum of their top-2 biased scores; weights are the unbiased scores.
    Then weights /= their sum if norm_topk_prob, and *= routed_scaling_factor.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    num_shared_experts: int  # shared MLP width = num_shared_experts * intermediate_size; 0: none
    layers: tuple[int, ...]  # indices of the layers whose MLP is this MoE
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"] = "greedy"
    num_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    shared_bias: bool = False  # the shared experts' linear layers carry a bias
    act: str = "silu"

    @property
    def shared(self) -> DenseMLPSpec:
        return DenseMLPSpec(self.num_shared_experts * self.intermediate_size, self.shared_bias)


# --- the whole model -------------------------------------------------------------------------
@dataclass(frozen=True)
class RuntimeConfig:
    """Everything the core needs to build and run a decoder-only model.

    The layer specs are typed by kind (`attention`: GQASpec | MLASpec, ...); a plugin may put
    its own spec type in any of them if it registers a module for it (`zoo_register_layers`).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    attention: AttentionSpec  # one kind for every layer
    mlp: DenseMLPSpec  # every layer's MLP, except the MoE layers below
    rope: RopeSpec
    norm: RMSNormSpec  # every norm of the decoder: before attention, before the MLP, final
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str  # the checkpoint's dtype: "float32" | "float16" | "bfloat16"
    bos_token_id: int | None = None  # None: the model has no BOS token
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    moe: MoESpec | None = None  # None: a dense model
    embedding: EmbeddingSpec = field(default_factory=EmbeddingSpec)
    mtp_layers: int = 0  # checkpoint layers past num_layers (multi-token prediction): not loaded

    def layer_mlp(self, i: int) -> DenseMLPSpec | MoESpec:
        """The MLP kind of layer i."""
        return self.moe if self.moe is not None and i in self.moe.layers else self.mlp

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes the static KV cache holds per token, all layers together.

        GQA: 2 * layers * kv_heads * head_dim * itemsize; MLA: layers * (kv_lora_rank +
        qk_rope_head_dim) * itemsize.
        """
        per_layer = sum(prod(s) for s in self.attention.cache_layout(1, 1).values())
        return self.num_layers * per_layer * itemsize
