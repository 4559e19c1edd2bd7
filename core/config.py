"""The frozen runtime config: what the core builds a model from.

Plugins turn a hub `config.json` into these (see `core.hfconfig`); derivations and validation
happen there, once. Nothing in here imports torch, so listing and inspecting models stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


RopeSpec = DefaultRope  # every kind is a DefaultRope subclass


# --- layer kinds -----------------------------------------------------------------------------
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


@dataclass(frozen=True)
class DenseMLPSpec:
    """down(act(gate(x)) * up(x)); act is "silu" (SwiGLU)."""

    intermediate_size: int
    bias: bool = False
    act: str = "silu"


# --- the whole model -------------------------------------------------------------------------
@dataclass(frozen=True)
class RuntimeConfig:
    """Everything the core needs to build and run a decoder-only model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    attention: GQASpec
    mlp: DenseMLPSpec
    rope: RopeSpec
    norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str  # the checkpoint's dtype: "float32" | "float16" | "bfloat16"
    bos_token_id: int | None = None  # None: the model has no BOS token
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes the static KV cache holds per token (all layers, K and V)."""
        a = self.attention
        return 2 * self.num_layers * a.num_kv_heads * a.head_dim * itemsize
