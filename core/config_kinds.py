"""The layer kinds beyond a Llama-style block's, as frozen specs (`core.config` holds the
common ones and the RuntimeConfig): recurrent (gated DeltaNet, Mamba2, short conv), sparse
(DeepSeek's DSA over MLA) and compressed (DeepSeek V4) attention, hyper-connected residual
streams (DeepSeek V4), Gemma 4's dense + routed MLP and per-layer inputs, and the sentinel of a
block without one of its two sub-blocks (Nemotron-H's one-mixer layers). Like core.config,
nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from core.config import DenseMLPSpec, MLASpec, MoESpec, RopeSpec


@dataclass(frozen=True, kw_only=True)
class SparseMLASpec(MLASpec):
    """MLA with DeepSeek sparse attention (DSA: DeepSeek V3.2, GLM-5): each query attends only
    to the `index_topk` earlier keys a lightning indexer scores highest.

    The indexer: q = wq_b(q_a_layernorm(q_a_proj(x))) (index_heads x index_head_dim), one key
    k = LayerNorm(wk(x)) (index_head_dim) per token, both roped on their first
    qk_rope_head_dim dims; score(t, s) = sum_h w_h(t) relu(q_h(t) . k(s) / sqrt(D)) with
    w = weights_proj(x) / sqrt(index_heads), in fp32. A layer with `shared_selection` has no
    indexer: it attends to the keys the previous indexer layer selected (GLM-5's shared
    layers), and caches no indexer keys.
    """

    index_heads: int
    index_head_dim: int
    index_topk: int
    index_rope_interleaved: bool  # V3.2: half-split pairs; GLM-5: interleaved, as MLA's rope
    shared_selection: bool = False

    def cache_layout(self, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
        """MLA's latent and k_pe, then the indexer's roped key per token (`index_k`)."""
        layout = super().cache_layout(batch, seq)
        if not self.shared_selection:
            layout["index_k"] = (batch, seq, self.index_head_dim)
        return layout


@dataclass(frozen=True)
class NoSubBlock:
    """In `RuntimeConfig.attention_layers` or `mlp_layers`: this layer has no such sub-block.
    The block builds neither it nor its norm and passes the residual stream on (Nemotron-H:
    each layer is one mixer, Mamba2, attention, MLP or MoE, behind one norm). A block left
    with one sub-block has one norm, `input_layernorm`, whichever sub-block it is; a layer
    without attention caches nothing."""

    rope: Literal["none"] = "none"

    def cache_layout(self, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
        return {}


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """A gated DeltaNet layer (linear attention: Qwen3-Next, Qwen3.5), in place of attention.

    x -> in_proj -> q, k (num_k_heads x head_k_dim), v, z (num_v_heads x head_v_dim), b, a
    (num_v_heads); q|k|v through a causal depthwise conv1d of `conv_kernel` taps and SiLU; q and
    k L2-normed; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T and
    o_t = S_t^T q_t / sqrt(dk); then o = RMSNorm(o) * silu(z) per v head, and out_proj. Value
    head j reads key head j // (num_v_heads / num_k_heads).

    What it caches is a fixed size per row, not per token (`recurrent`): the conv's last
    conv_kernel - 1 inputs and the (head_k_dim x head_v_dim) state per value head, in fp32.
    `layout`: how the checkpoint packs in_proj: "flat" (Qwen3.5: in_proj_qkv | z | b | a) or
    "grouped" (Qwen3-Next: in_proj_qkvz and in_proj_ba, rows grouped per key head).
    """

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    norm_eps: float
    layout: Literal["flat", "grouped"] = "flat"
    rope: Literal["none"] = "none"  # no rotary embedding
    recurrent: ClassVar[bool] = True  # a fixed-size state per row: no per-token cache

    def __post_init__(self):
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"GatedDeltaNetSpec: num_v_heads ({self.num_v_heads}) must be a multiple of "
                f"num_k_heads ({self.num_k_heads})"
            )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim  # q | k | v

    def cache_layout(self, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
        """The per-row state (seq is not used): the conv's last inputs (B, conv_dim, K - 1)
        and the delta-rule state (B, H_v, D_k, D_v)."""
        return {
            "conv": (batch, self.conv_dim, self.conv_kernel - 1),
            "state": (batch, self.num_v_heads, self.head_k_dim, self.head_v_dim),
        }

    def cache_dtypes(self) -> dict[str, str]:
        """Tensors kept in another dtype than the model's: the state accumulates in fp32."""
        return {"state": "float32"}


@dataclass(frozen=True, kw_only=True)
class Mamba2Spec:
    """A Mamba2 (SSD) mixer in place of attention (Granite 4.0-H, Nemotron-H, Bamba).

    x -> in_proj -> z (intermediate) | xBC (conv_dim) | dt (num_heads); xBC through a causal
    depthwise conv1d of `conv_kernel` taps (+ bias) and SiLU, split into x (num_heads x
    head_dim), B and C (n_groups x state_size); dt = clamp(softplus(dt + dt_bias),
    time_step_limit), A = -exp(A_log); the scan h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,
    y_t = h_t C_t + D x_t (head h reads group h // (num_heads / n_groups)); then
    y = RMSNorm(y * silu(z)) over groups of intermediate / n_groups channels, and out_proj.
    `gated_norm`: "gate_first" (that, mamba_ssm's norm_before_gate=False), "norm_first"
    (RMSNorm(y) * silu(z): Falcon-H1's mamba_norm_before_gate) or "none" (y * silu(z), no norm
    nor its weight: Falcon-H1 without mamba_rms_norm).

    Its cache is a fixed size per row (`recurrent`): the conv's last conv_kernel - 1 inputs and
    the (head_dim x state_size) state per head, in fp32.
    """

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    norm_eps: float
    conv_bias: bool = True  # conv1d.bias
    bias: bool = False  # in_proj.bias (and out_proj.bias unless out_bias says otherwise)
    out_bias: bool | None = None  # out_proj.bias; None: as `bias` (Falcon-H1: projectors_bias)
    gated_norm: Literal["gate_first", "norm_first", "none"] = "gate_first"
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    rope: Literal["none"] = "none"  # no rotary embedding
    recurrent: ClassVar[bool] = True  # a fixed-size state per row: no per-token cache
    kind: ClassVar[str] = "mamba2"  # for `zoo info`

    def __post_init__(self):
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"Mamba2Spec: num_heads ({self.num_heads}) must be a multiple of n_groups "
                f"({self.n_groups})"
            )

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.state_size  # x | B | C

    @property
    def norm_group_size(self) -> int:
        """Channels per group of the gated RMSNorm (one group per B/C group)."""
        return self.intermediate // self.n_groups

    def cache_layout(self, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
        """The per-row state (seq is not used): the conv's last inputs (B, conv_dim, K - 1)
        and the SSM state (B, H, head_dim, state_size)."""
        return {
            "conv": (batch, self.conv_dim, self.conv_kernel - 1),
            "ssm": (batch, self.num_heads, self.head_dim, self.state_size),
        }

    def cache_dtypes(self) -> dict[str, str]:
        """Tensors kept in another dtype than the model's: the SSM state accumulates in fp32."""
        return {"ssm": "float32"}


@dataclass(frozen=True)
class ShortConvSpec:
    """A gated short convolution (LFM2's conv layers), in place of attention.

    x -> in_proj -> B, C, x' (hidden each); y = C * conv(B * x'), the conv causal and depthwise
    with `l_cache` taps per channel; then out_proj. `bias`: in_proj, the conv and out_proj
    carry a bias (LFM2's `conv_bias`).

    What it caches is a fixed size per row (`recurrent`): the conv's last l_cache - 1 inputs.
    """

    hidden: int
    l_cache: int
    bias: bool = False
    rope: Literal["none"] = "none"  # no rotary embedding
    recurrent: ClassVar[bool] = True  # a fixed-size state per row: no per-token cache
    kind: ClassVar[str] = "short conv"  # its name in `zoo info`

    def __post_init__(self):
        if self.l_cache < 2:
            raise ValueError(f"ShortConvSpec: l_cache must be at least 2, got {self.l_cache}")

    def cache_layout(self, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
        """The per-row state (seq is not used): the conv's last inputs (B, hidden, L - 1)."""
        return {"conv": (batch, self.hidden, self.l_cache - 1)}


@dataclass(frozen=True)
class ParallelMixerSpec:
    """Attention and Mamba2 side by side on the same normed input, their outputs summed
    (Falcon-H1): out = attn(x) + mamba(x). Each keeps its own cache tensors: the attention's
    per-token keys and values, and Mamba2's fixed-size per-row state, so the cache (which
    tells them apart per tensor) treats the row as recurrent and snapshots the state."""

    attention: Any  # a GQASpec
    mamba: Mamba2Spec
    kind: ClassVar[str] = "attention + mamba2"  # for `zoo info`

    def __post_init__(self):
        # the cache tells a ring from a state by the layer's `window`, which this layer has
        # not: a sliding attention's ring would be kept and snapshotted as a recurrent state
        if getattr(self.attention, "window", None) is not None:
            raise ValueError(
                "ParallelMixerSpec: its attention has a sliding window, which a parallel layer "
                "does not support (only full attention beside Mamba2)"
            )

    @property
    def rope(self) -> Any:
        return self.attention.rope  # the attention's rope: the layer's

    def cache_layout(self, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
        """The attention's tensors (k, v), then Mamba2's (conv, ssm), in the module's order."""
        return self.attention.cache_layout(batch, seq) | self.mamba.cache_layout(batch, seq)

    def cache_dtypes(self) -> dict[str, str]:
        return self.mamba.cache_dtypes()


@dataclass(frozen=True)
class CompressedAttentionSpec:
    """DeepSeek V4's attention: one shared key=value head (MQA), q through q_a -> norm -> q_b
    and an unweighted per-head RMSNorm, interleaved rope on each head's LAST `rope_dim` dims
    (undone on the output, as V = K), a learned sink per head, and a grouped low-rank output
    projection (o_groups x o_lora_rank). Every query sees the last `sliding_window` tokens;
    with `compress_rate` > 0 it also sees compressed entries, one per closed window of
    `compress_rate` tokens (a softmax-gated sum of the window's projections): HCA
    (`index_heads` 0) sees every closed one, CSA (`index_heads` > 0: windows overlap by one,
    and a lightning indexer keeps the `index_topk` best) only those picked for it.

    The cache keeps each token's key=value and, for compressed layers, each token's
    compressor (and indexer) projections; the compressed entries are rebuilt from them on
    every forward, so a row's state is its positions alone (rows copy and roll back freely).
    """

    num_heads: int
    head_dim: int
    q_lora_rank: int
    rope_dim: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    norm_eps: float
    rope: RopeSpec  # main rope (sliding layers) or the compress rope (CSA / HCA layers)
    compress_rate: int = 0  # 0: sliding window only
    index_heads: int = 0  # 0: no indexer (HCA or sliding); CSA: the indexer's heads
    index_head_dim: int = 0
    index_topk: int = 0

    @property
    def kind(self) -> str:
        """For `zoo info`: 'window 128', 'window 128 + CSA 4 (top 512)', 'window 128 + HCA 128'."""
        window = f"window {self.sliding_window}"
        if not self.compress_rate:
            return window
        if self.index_heads:
            return f"{window} + CSA {self.compress_rate} (top {self.index_topk})"
        return f"{window} + HCA {self.compress_rate}"

    @property
    def overlap(self) -> int:
        """Projections per token per compressed series: 2 (CSA's overlapping windows) or 1."""
        return 2 if self.index_heads else 1

    def cache_layout(self, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
        """kv: the roped key=value per token; ckv / cgate: the compressor's projections per
        token (compressed layers); ikv / igate: the indexer's (CSA)."""
        out = {"kv": (batch, seq, self.head_dim)}
        if self.compress_rate:
            width = self.overlap * self.head_dim
            out |= {"ckv": (batch, seq, width), "cgate": (batch, seq, width)}
        if self.index_heads:
            width = 2 * self.index_head_dim
            out |= {"ikv": (batch, seq, width), "igate": (batch, seq, width)}
        return out


@dataclass(frozen=True)
class HyperConnectionSpec:
    """Manifold-constrained hyper-connections (DeepSeek V4): the residual is `mult` streams;
    each sub-block reads a weighted sum of them (pre), and the streams become
    post * out + comb^T @ streams, with comb made doubly stochastic by `sinkhorn_iters`
    Sinkhorn-Knopp steps; the final streams collapse to one before the last norm."""

    mult: int
    sinkhorn_iters: int
    eps: float  # added to pre and comb, and to the Sinkhorn denominators
    norm_eps: float  # the unweighted RMSNorm over the flattened streams


@dataclass(frozen=True)
class DenseMoESpec:
    """Gemma 4's MoE layers: a dense MLP and routed experts side by side, each with norms of its
    own, summed: post_1(mlp(x)) + post_2(experts(pre_2(h), route(h))), x the block's pre-MLP
    norm of its residual stream h. The router reads h itself: weightless-norm(h) * scale *
    hidden ** -0.5 @ W, softmax, top-k renormalised, each weight times its expert's learned
    scale (parameters router.scale (hidden,), router.per_expert_scale (E,))."""

    dense: DenseMLPSpec
    moe: MoESpec  # routing and the experts' shapes; `act` is the experts' activation
    norm: Any  # the spec of the three norms


@dataclass(frozen=True)
class PerLayerInputSpec:
    """Gemma 4's per-layer embeddings (PLE): each layer gets a `dim`-wide input of its own,
    (norm(x0 @ W_proj * hidden ** -0.5) + E_ple[token] * sqrt(dim)) / sqrt(2) for the token's
    embedding x0 (E_ple: vocab_size x (layers * dim), scale rounded to the model dtype); after
    its MLP a block adds norm(proj(act(gate(h)) * that input)) to h."""

    dim: int
    vocab_size: int
    norm: Any  # the norm spec of the projection's norm and the block's post norm
    act: Literal["gelu_tanh"] = "gelu_tanh"


@dataclass(frozen=True)
class MTPSpec:
    """A multi-token-prediction layer of DeepSeek V3's kind (also GLM-4.5's), stored after the
    decoder's as `model.layers.{num_layers}.*`: the next token's embedding and a position's
    last hidden state, each RMS-normed, concatenated and projected back to the hidden size,
    then a decoder layer of these kinds (core/mtp.py). `mlp`: a DenseMLPSpec or MoESpec (its
    `layers` unread)."""

    attention: Any
    mlp: Any
