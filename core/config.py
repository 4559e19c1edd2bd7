"""The frozen runtime config: what the core builds a model from.

Plugins turn a hub `config.json` into these (see `core.hfconfig`); derivations and validation
happen there, once. Nothing in here imports torch, so listing and inspecting models stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from core.config_kinds import HyperConnectionSpec, MTPSpec, PerLayerInputSpec


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


@dataclass(frozen=True, kw_only=True)
class LongRope(DefaultRope):
    """LongRoPE (Phi-3's 128k models, Phi-3.5, Phi-4-mini): inv_freq_i = 1 / (factor_i *
    theta ** (2i / dim)), with `short_factor` while a sequence stays within
    original_max_position_embeddings and `long_factor` once it passes it. As in transformers, a
    forward picks one set for all its tokens by its last position (per row here), so keys cached
    by an earlier, shorter call keep the short set. cos and sin are multiplied by
    `attention_factor` (sqrt(1 + ln(factor) / ln(original)) unless the config gives it)."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float = 1.0


@dataclass(frozen=True, kw_only=True)
class ProportionalRope(DefaultRope):
    """Gemma 4's global layers: the whole head (`dim`) is rotated in halves (i, i + dim/2), but
    only the first `rotated` frequencies turn, theta ** (-2i / dim); the others are 0 (cos 1,
    sin 0: those dims pass through). Differs from a partial rope (Phi-3): the turning pairs
    are spread over both halves of the head, and the exponent divides by the whole head_dim."""

    rotated: int  # frequencies that turn, of dim / 2


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
    """x / sqrt(mean(x^2) + eps) * (offset + weight), accumulated in fp32.

    offset 0: Llama's rounding (normalise in fp32, cast back, then scale). offset 1: Gemma's
    weight stored as a difference from 1, the whole product in fp32 and cast back at the end.
    """

    eps: float
    offset: float = 0.0
    # OLMo 2 / 3, Gemma 4: the weight multiplies the fp32 normed x and the product is cast back (the
    # Gemma path with offset 0), where Llama casts back before scaling
    fp32_scale: bool = False
    # DeepSeek V4: besides, the weight is kept in fp32 whatever the model's dtype (fp32_scale)
    fp32_weight: bool = False


@dataclass(frozen=True)
class L2NormSpec:
    """x / sqrt(mean(x^2) + eps) in fp32, cast back; no weight (Llama 4's q/k norm)."""

    eps: float


@dataclass(frozen=True)
class QueryScale:
    """After rope, q at position p times f = 1 + beta * log(1 + floor((p + offset) / period)),
    computed in fp32. Ministral 3 (`llama_4_scaling_beta`, period the original context, offset
    0) rounds f to q's dtype before the product; Llama 4's NoPE layers (`attn_scale`,
    `floor_scale`, offset 1) round the fp32 product (`round_factor` False)."""

    beta: float
    period: float
    offset: int = 0
    round_factor: bool = True


@dataclass(frozen=True)
class GQASpec:
    """Grouped-query attention: num_heads query heads share num_kv_heads key/value heads.

    One spec per layer (`RuntimeConfig.layer_attention(i)`); besides its shape a layer may
    - `window`: attend to the current token and the window - 1 before it (transformers'
      sliding window); its cache is then a ring buffer of `window` positions;
    - `rope`: "model" rotates q and k with `RuntimeConfig.rope`, "none" not at all (NoPE), a
      rope spec with its own (a local rope base);
    - `softmax_scale`: replace head_dim ** -0.5;
    - `softcap`: scores -> softcap * tanh(scores / softcap) before the softmax;
    - `sinks`: a learned logit per query head (parameter `sinks`, (num_heads,)) that joins
      each softmax's denominator and attends to nothing (gpt-oss);
    - `qk_norm`: a norm over head_dim of every q and k head before rope (parameters
      `q_norm`, `k_norm`; built from the norm spec's type, like every norm);
    - `output_gate`: a sigmoid gate per output dim, computed by q_proj beside q;
    - `qk_norm_all_heads`: `qk_norm` runs over the whole q and k projections (all heads
      together: num_heads * head_dim and num_kv_heads * head_dim) instead of per head (OLMo 2 /
      3, MiniMax M2);
    - `query_scale`: a `QueryScale`, q times a factor that grows with its position
      (Ministral 3's llama_4_scaling_beta, Llama 4's NoPE temperature tuning);
    - `chunk`: attend only within the query's chunk, positions (p // chunk) * chunk .. p
      (Llama 4); its cache keeps every position, as a full layer's, and attention reads the
      chunk's slice of it.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    window: int | None = None  # None: full attention
    rope: RopeSpec | Literal["model", "none"] = "model"
    softmax_scale: float | None = None  # None: head_dim ** -0.5
    softcap: float | None = None  # None: no soft-capping
    sinks: bool = False
    qk_norm: RMSNormSpec | Any | None = None  # None: no q/k norm; a norm spec of any kind
    # Qwen3-Next / Qwen3.5: q_proj also yields a gate per head (rows [q_h | gate_h] per head h);
    # the attention output is multiplied by sigmoid(gate) before o_proj
    output_gate: bool = False
    qk_norm_all_heads: bool = False
    query_scale: QueryScale | None = None  # None: q is not scaled
    chunk: int | None = None  # None: no chunking
    # Gemma 4: v normed per head over head_dim by a weightless RMSNorm of this eps (None: not)
    v_norm: float | None = None
    # Gemma 4's MoE models' global layers: no v_proj; the values are k_proj's output (before
    # the k norm and rope)
    k_eq_v: bool = False
    # Gemma 4's last layers: no k/v projections and no cache of their own; they attend over
    # the keys and values layer `kv_source` (an earlier layer of the same kind) attended over
    kv_source: int | None = None

    def __post_init__(self):
        for name in ("window", "softcap", "softmax_scale", "chunk"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"GQASpec.{name} must be positive or None, got {value!r}")
        if self.window is not None and self.chunk is not None:
            raise ValueError("GQASpec: a layer has a sliding window or chunks, not both")

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.softmax_scale is None else self.softmax_scale

    def cache_layout(self, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
        """What one layer caches, in the order forward() takes it: K and V per kv head, for
        every position (full) or the last `window` ones (a ring buffer: position p in slot
        p % window). A layer reading another's (kv_source) caches nothing."""
        if self.kv_source is not None:
            return {}
        if self.window is not None:
            seq = min(seq, self.window)
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
    """down(act(gate(x)) * up(x)); act is "silu" (SwiGLU) or "gelu_tanh" (GeGLU: GELU with
    the tanh approximation, Gemma). Not `gated` (Nemotron-H): down(act(up(x))), act "relu2"
    (squared ReLU, relu(x) ** 2)."""

    intermediate_size: int
    bias: bool = False
    act: Literal["silu", "gelu_tanh", "relu2"] = "silu"
    gated: bool = True


@dataclass(frozen=True)
class GLUSpec:
    """gpt-oss's clamped SwiGLU: gate_up's rows alternate gate, up (2j, 2j + 1); gate is
    clamped to at most `limit`, up to [-limit, limit]; out = (up + 1) * gate * sigmoid(alpha *
    gate) (transformers' GptOssExperts._apply_gate)."""

    alpha: float = 1.702
    limit: float = 7.0


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
    scoring: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"] = "greedy"
    num_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    shared_bias: bool = False  # the shared experts' linear layers carry a bias
    act: str = "silu"
    # gpt-oss: a bias on the router and on each routed expert's gate_up / down projections
    bias: bool = False
    # the routed experts' activation: None is SwiGLU, silu(gate) * up over [gate | up] rows;
    # a GLUSpec is gpt-oss's clamped SwiGLU over interleaved (gate, up) rows
    glu: GLUSpec | None = None
    # Qwen2-MoE / Qwen3-Next / Qwen3.5: one shared expert of its own width (None: the
    # num_shared_experts * intermediate_size above), its output scaled by sigmoid(x @ w) when
    # `shared_gate` (parameter shared_expert_gate, (1, hidden))
    shared_intermediate_size: int | None = None
    shared_gate: bool = False
    # Llama 4: each routed expert runs on its weight times x, expert(w * x), not w * expert(x)
    scale_input: bool = False
    # DeepSeek V4 (core/layers/hash_moe.py; the plain MoE refuses them): routed and shared
    # experts clamp gate to at most `swiglu_limit` and up to [-limit, limit] before SiLU(gate) *
    # up; on `hash_layers` the experts are a fixed table of the token id (tid2eid), not top-k
    swiglu_limit: float | None = None
    hash_layers: tuple[int, ...] = ()
    # Nemotron-H: routed and shared experts are not gated, down(act(up(x))) (parameters
    # experts.up_proj, shared_experts.up_proj), with `act` "relu2" for both; the router's
    # weight kept in fp32 whatever the model's dtype (`router_fp32`, as transformers keeps it)
    gated: bool = True
    router_fp32: bool = False

    @property
    def shared_width(self) -> int:
        """The shared experts' MLP width; 0: none."""
        if self.shared_intermediate_size is not None:
            return self.shared_intermediate_size
        return self.num_shared_experts * self.intermediate_size

    @property
    def shared(self) -> DenseMLPSpec:
        if not self.gated:  # Nemotron-H: the shared expert is the routed ones' kind
            return DenseMLPSpec(self.shared_width, self.shared_bias, act=self.act, gated=False)
        return DenseMLPSpec(self.shared_width, self.shared_bias)


# --- the whole model -------------------------------------------------------------------------
@dataclass(frozen=True)
class RuntimeConfig:
    """Everything the core needs to build and run a decoder-only model.

    The layer specs are typed by kind (`attention`: GQASpec | MLASpec, ...); a plugin may put
    its own spec type in any of them if it registers a module for it (`zoo_register_layers`).
    Attention is per layer (`attention_layers`, read through `layer_attention(i)`): a model may
    mix full and sliding layers, roped and NoPE ones, or kinds of its own.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    attention: AttentionSpec  # the model's attention kind; layers that differ: attention_layers
    mlp: DenseMLPSpec  # every layer's MLP, except the MoE layers below
    rope: RopeSpec  # the model's rope; a layer may have its own, or none (GQASpec.rope)
    norm: RMSNormSpec  # every norm of the decoder: before attention, before the MLP, final
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str  # the checkpoint's dtype: "float32" | "float16" | "bfloat16"
    bos_token_id: int | None = None  # None: the model has no BOS token
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    moe: MoESpec | None = None  # None: a dense model
    embedding: EmbeddingSpec = field(default_factory=EmbeddingSpec)
    mtp_layers: int = 0  # checkpoint layers past num_layers (multi-token prediction): not loaded
    # ... unless speculative decoding runs the first (load_model(speculative="mtp")), of this
    # kind; None: the family's MTP layers (if any) are not of a kind the core runs
    mtp: MTPSpec | None = None
    logits_scale: float = 1.0  # the LM head's logits are multiplied by this (Granite: 1/scaling)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2); None: off
    # a norm on each sub-block's output before its residual add, besides the pre-norms
    # (Gemma 2 / 3's sandwich: parameters attn_out_layernorm, post_feedforward_layernorm)
    post_norms: bool = False
    # False: no norm before attention nor before the MLP (OLMo 2 / 3 norm only each sub-block's
    # output; with post_norms)
    pre_norms: bool = True
    # one attention spec per layer (any kind: a hybrid model mixes them); () = `attention` on
    # every layer, filled in here
    attention_layers: tuple[Any, ...] = ()
    # DeepSeek V4: the residual is several streams mixed by hyper-connections (the blocks are
    # core.layers.hyper's); None: the plain residual of DecoderBlock
    hyper_connections: HyperConnectionSpec | None = None
    # one MLP spec per layer where they differ (Gemma 4's double-wide last layers, its
    # DenseMoESpec layers); () = `mlp` on every layer; the layers of `moe` still take it
    mlp_layers: tuple[Any, ...] = ()
    per_layer_input: PerLayerInputSpec | None = None  # Gemma 4's per-layer embeddings
    # each block's output is multiplied by a learned scalar (parameter layer_scalar, (1,))
    layer_scalar: bool = False
    # each sub-block's output is multiplied by this before its residual add (Granite's
    # residual_multiplier): h = x + scale * attn(...), out = h + scale * mlp(...)
    residual_scale: float = 1.0

    def __post_init__(self):
        if not self.attention_layers:
            object.__setattr__(self, "attention_layers", (self.attention,) * self.num_layers)
        if len(self.attention_layers) != self.num_layers:
            raise ValueError(
                f"RuntimeConfig: {len(self.attention_layers)} attention_layers for "
                f"{self.num_layers} layers"
            )

    def layer_attention(self, i: int) -> AttentionSpec:
        """The attention spec of layer i."""
        return self.attention_layers[i]

    def layer_rope(self, i: int) -> RopeSpec | None:
        """The rope layer i rotates q and k with; None: none (a NoPE layer)."""
        rope = getattr(self.attention_layers[i], "rope", "model")
        return self.rope if rope == "model" else None if rope == "none" else rope

    def layer_mlp(self, i: int) -> DenseMLPSpec | MoESpec:
        """The MLP kind of layer i."""
        if self.moe is not None and i in self.moe.layers:
            return self.moe
        return self.mlp_layers[i] if self.mlp_layers else self.mlp

    def kv_bytes(self, itemsize: int, seq_len: int, batch: int = 1) -> int:
        """Bytes the cache holds for `batch` sequences of `seq_len` tokens, all layers
        together; a sliding layer holds at most its window, a recurrent one its fixed state."""
        return sum(
            prod(shape) * _itemsize(spec, name, itemsize)
            for spec in self.attention_layers
            for name, shape in spec.cache_layout(batch, seq_len).items()
        )

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes the KV cache holds per token in the layers that keep every token (all but the
        sliding ones, whose ring buffers stop growing at their window, and the recurrent ones).

        GQA: 2 * layers * kv_heads * head_dim * itemsize; MLA: layers * (kv_lora_rank +
        qk_rope_head_dim) * itemsize.
        """
        full = [s for s in self.attention_layers if getattr(s, "window", None) is None]
        return sum(prod(x) for s in full for x in _tensors(s, grows=True)) * itemsize

    def state_bytes_per_sequence(self, itemsize: int) -> int:
        """Bytes of fixed-size state per sequence: the recurrent layers' (linear attention)
        conv and delta-rule states, whatever the sequence's length; 0 for attention only."""
        return sum(
            prod(spec.cache_layout(1, 1)[name]) * _itemsize(spec, name, itemsize)
            for spec in self.attention_layers
            if getattr(spec, "window", None) is None
            for name in _tensors(spec, grows=False, names=True)
        )


def _tensors(spec: Any, grows: bool, names: bool = False) -> list:
    """A layer's cache tensors that grow with the sequence (keys, values) or, `grows` False,
    those that do not (a recurrent state; Falcon-H1's layers hold both): their one-row,
    one-token shapes, or their `names`."""
    one, two = spec.cache_layout(1, 1), spec.cache_layout(1, 2)
    return [n if names else one[n] for n in one if (one[n] != two[n]) == grows]


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _itemsize(spec: Any, name: str, default: int) -> int:
    """Bytes per element of a layer's cache tensor `name`: the model's, unless the spec keeps
    it in another dtype (`cache_dtypes`)."""
    dtypes = spec.cache_dtypes() if hasattr(spec, "cache_dtypes") else {}
    return _ITEMSIZE[dtypes[name]] if name in dtypes else default
