"""llama.cpp's GGUF architectures, as gguf.py maps them onto hub checkpoints.

Per `general.architecture` (`ARCHITECTURES`): the hub's model_type, the file's tensor names ->
the hub's, `{arch}.*` metadata keys -> config.json keys, and what llama.cpp implies without
storing it (defaults, and `configure` functions for what takes more than a rename).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plugins.formats.gguf_families import (
    ATTN,
    DEEPSEEK2,
    DSA,
    EXPERTS,
    GEMMA2_KEYS,
    GEMMA2_NORMS,
    GEMMA4,
    GEMMA4_KEYS,
    GLM4MOE,
    GLM4MOE_KEYS,
    GPT_OSS,
    GRANITE_HYBRID,
    GRANITE_HYBRID_KEYS,
    LFM2,
    LFM2_KEYS,
    LLAMA4,
    MINIMAXM2,
    MIXTRAL,
    MOE_KEYS,
    configure_deepseek2,
    configure_dsa,
    configure_gemma2,
    configure_gemma3,
    configure_gemma4,
    configure_glm4moe,
    configure_granite_hybrid,
    configure_lfm2,
    configure_llama4,
    configure_mistral3,
    configure_olmo2,
    join_kv_b,
)
from plugins.formats.gguf_fixes import (
    FALCON_H1_KEYS,
    FALCON_H1_TENSORS,
    GRANITE_HYBRID_FIXES,
    HYBRID_KEYS,
    NEMOTRON_H_FIXES,
    NEMOTRON_H_KEYS,
    NEMOTRON_H_TENSORS,
    QWEN3_5_FIXES,
    QWEN3_5_TENSORS,
    QWEN3_NEXT_FIXES,
    QWEN3_NEXT_TENSORS,
    Fix,
    falcon_h1_config,
    hybrid_config,
    nemotron_h_config,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Join:
    """One hub tensor that llama.cpp stores as several: `parts` (the file's names, layer as {},
    no leaf), whose tensors `join` puts back together in that order. Read as floats: its
    blocks are not kept (the join moves values across the rows that blocks are made of)."""

    parts: tuple[str, ...]
    join: Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Arch:
    """How one `general.architecture` of llama.cpp's maps onto a hub checkpoint."""

    model_type: str  # the hub's model_type (config.json)
    permuted: bool = False  # llama.cpp stored the q/k rows in its own rope order
    tensors: dict[str, str] = field(default_factory=dict)  # beside TENSOR_NAMES
    config: dict[str, str] = field(default_factory=dict)  # beside CONFIG_KEYS: {arch}.key -> key
    defaults: dict[str, Any] = field(default_factory=dict)  # what llama.cpp implies, not stores
    moe: Arch | None = None  # what the architecture is when the file has experts (llama: Mixtral)
    # rope.dimension_count is the roped part of each head (partial_rotary_factor), not head_dim
    partial_rope: bool = False
    joins: dict[str, Join] = field(default_factory=dict)  # hub name (layer as {}) -> its parts
    # what the metadata implies beyond renames, last: (meta(key, default), config, the file's
    # path) -> config
    configure: Callable[[Callable[..., Any], dict[str, Any], Path], dict[str, Any]] | None = None
    norm_offset: float = 0.0  # llama.cpp stored each norm weight plus this (Gemma's 1 + w: 1)
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # implied beside a stored scaling
    fixes: dict[str, Fix] = field(default_factory=dict)  # file template -> what to undo on read
    # the config key that says whether q and k are normed, set from the file's attn_q_norm
    # tensors where the metadata does not store it (GLM-4.5: `use_qk_norm`)
    qk_norm_key: str | None = None
    # rope_freqs.weight marks the frequencies that turn (1) and those that stand still (1e30):
    # Gemma 4's proportional rope on its global layers, not Llama 3.1's scaling factors
    proportional_rope: bool = False


# llama.cpp tensor name (layer index as {}) -> hub name; unlisted names pass through unchanged
# (and the loader reports them as unexpected). Stacked experts (`_exps`, (experts, rows, cols))
# become the hub's one tensor per expert ({e}), each read as its slice of the stack.
TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{}.attn_norm": "model.layers.{}.input_layernorm",
    "blk.{}.attn_q": "model.layers.{}.self_attn.q_proj",
    "blk.{}.attn_k": "model.layers.{}.self_attn.k_proj",
    "blk.{}.attn_v": "model.layers.{}.self_attn.v_proj",
    "blk.{}.attn_output": "model.layers.{}.self_attn.o_proj",
    "blk.{}.attn_q_norm": "model.layers.{}.self_attn.q_norm",
    "blk.{}.attn_k_norm": "model.layers.{}.self_attn.k_norm",
    "blk.{}.ffn_norm": "model.layers.{}.post_attention_layernorm",
    "blk.{}.ffn_gate": "model.layers.{}.mlp.gate_proj",
    "blk.{}.ffn_up": "model.layers.{}.mlp.up_proj",
    "blk.{}.ffn_down": "model.layers.{}.mlp.down_proj",
}
# DeepSeek V2 / V3 / R1 (MLA, its kv_b_proj split in two by llama.cpp), V3.2 and GLM-5's base
DEEPSEEK2_ARCH = Arch(
    "deepseek_v2",
    tensors=DEEPSEEK2,
    config={
        "expert_used_count": "num_experts_per_tok",
        "expert_feed_forward_length": "moe_intermediate_size",
    },
    joins={f"{ATTN}.kv_b_proj": Join(("blk.{}.attn_k_b", "blk.{}.attn_v_b"), join_kv_b)},
    configure=configure_deepseek2,
)

ARCHITECTURES = {
    # Llama 2/3, SmolLM2, Mistral; with experts, Mixtral (llama.cpp writes both as `llama`)
    "llama": Arch(
        "llama",
        permuted=True,
        moe=Arch(
            "mixtral",
            permuted=True,
            tensors=MIXTRAL,
            config={"expert_count": "num_local_experts", **MOE_KEYS},
        ),
    ),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3"),
    # llama.cpp's qwen3moe graph always renormalizes the chosen experts' weights
    "qwen3moe": Arch(
        "qwen3_moe",
        tensors=EXPERTS,
        config={"expert_count": "num_experts", **MOE_KEYS},
        defaults={"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    ),
    # llama.cpp runs every 4th layer without rope (its own constant, as transformers' default)
    "smollm3": Arch("smollm3", permuted=True, defaults={"no_rope_layer_interval": 4}),
    # Phi-3 / 3.5 / 4-mini: the hub's fused q|k|v and gate|up as they are; a sliding window of 0
    # is none (what the converter writes for a null one); LongRoPE's factors are tensors
    "phi3": Arch(
        "phi3",
        tensors={
            "blk.{}.attn_qkv": "model.layers.{}.self_attn.qkv_proj",
            "blk.{}.ffn_up": "model.layers.{}.mlp.gate_up_proj",
        },
        config={
            "attention.sliding_window": "sliding_window",
            "rope.scaling.original_context_length": "original_max_position_embeddings",
        },
        partial_rope=True,
    ),
    # DeepSeek V2 / V2-Lite / V3 / R1: MLA, MoE with shared experts after leading dense layers
    "deepseek2": DEEPSEEK2_ARCH,
    # DeepSeek V3.2 and GLM-5: deepseek2 plus DSA's indexer (its model_type: from the arch)
    "deepseek32": replace(
        DEEPSEEK2_ARCH, model_type="deepseek_v32", tensors=DSA, configure=configure_dsa
    ),
    "glm-dsa": replace(
        DEEPSEEK2_ARCH, model_type="glm_moe_dsa", tensors=DSA, configure=configure_dsa
    ),
    # Gemma's norms are (1 + w). The Gemma 1/2 converters store no rope base: llama.cpp runs its
    # default, 10000. llama.cpp windows Gemma 2's layers 1 in 2 and Gemma 3's 5 in 6 (unless the
    # file says otherwise), as transformers' defaults have them.
    "gemma": Arch("gemma", norm_offset=1.0, defaults={"rope_theta": 10000.0}),
    "gemma2": Arch(
        "gemma2",
        norm_offset=1.0,
        tensors=GEMMA2_NORMS,
        config=GEMMA2_KEYS,
        defaults={"rope_theta": 10000.0},
        configure=configure_gemma2,
    ),
    "gemma3": Arch(
        "gemma3_text",
        norm_offset=1.0,
        tensors=GEMMA2_NORMS,
        config={
            **GEMMA2_KEYS,
            "attention.sliding_window_pattern": "sliding_window_pattern",
            "rope.freq_base_swa": "rope_local_base_freq",
        },
        defaults={"rope_theta": 10000.0},
        configure=configure_gemma3,
    ),
    # Gemma 4 (E2B, E4B, 31B, 26B-A4B): norms stored as they are (w, not 1 + w); what differs
    # from gemma3 in its metadata is read by configure_gemma4
    "gemma4": Arch(
        "gemma4_text",
        tensors=GEMMA4,
        config=GEMMA4_KEYS,
        configure=configure_gemma4,
        proportional_rope=True,
    ),
    # llama.cpp's graph hard-codes gpt-oss's SwiGLU (alpha 1.702, clamped at 7) and slides every
    # even layer (set_swa_pattern(2): GptOssConfig's default without layer_types). Its yarn
    # rounds the correction range; the model's own (OpenAI's, transformers') does not.
    "gpt-oss": Arch(
        "gpt_oss",
        tensors=GPT_OSS,
        config={
            "attention.sliding_window": "sliding_window",
            "expert_count": "num_local_experts",
            "expert_used_count": "num_experts_per_tok",
        },
        defaults={"swiglu_alpha": 1.702, "swiglu_limit": 7.0},
        rope_scaling={"truncate": False},
    ),
    # Qwen3-Next, Qwen3.5 (dense, MoE): gated DeltaNet beside gated attention layers, norms
    # (1 + w) (gguf_fixes.py). llama.cpp's qwen3next graph renormalizes the chosen
    # experts' weights; its converter writes no dense layer in a qwen3next.
    "qwen3next": Arch(
        "qwen3_next",
        tensors={**EXPERTS, **QWEN3_NEXT_TENSORS},
        config={**MOE_KEYS, **HYBRID_KEYS},
        defaults={"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
        partial_rope=True,
        configure=hybrid_config,
        norm_offset=1.0,
        fixes=QWEN3_NEXT_FIXES,
    ),
    "qwen35": Arch(
        "qwen3_5_text",
        tensors=QWEN3_5_TENSORS,
        config=HYBRID_KEYS,
        partial_rope=True,
        configure=hybrid_config,
        norm_offset=1.0,
        fixes=QWEN3_5_FIXES,
    ),
    "qwen35moe": Arch(
        "qwen3_5_moe_text",
        tensors={**EXPERTS, **QWEN3_5_TENSORS},
        config={**MOE_KEYS, **HYBRID_KEYS},
        partial_rope=True,
        configure=hybrid_config,
        norm_offset=1.0,
        fixes=QWEN3_5_FIXES,
    ),
    # Nemotron-H (dense; MoE: Nemotron 3 Nano): Mamba2, NoPE attention, relu2 MLP / MoE layers,
    # one norm each (gguf_fixes.py)
    **dict.fromkeys(
        ("nemotron_h", "nemotron_h_moe"),
        Arch(
            "nemotron_h",
            tensors=NEMOTRON_H_TENSORS,
            config=NEMOTRON_H_KEYS,
            configure=nemotron_h_config,
            fixes=NEMOTRON_H_FIXES,
        ),
    ),
    # OLMo 2 / 3: norms after attention and after the MLP only (no attn_norm nor ffn_norm)
    "olmo2": Arch(
        "olmo2",
        tensors={
            "blk.{}.post_attention_norm": "model.layers.{}.post_attention_layernorm",
            "blk.{}.post_ffw_norm": "model.layers.{}.post_feedforward_layernorm",
        },
        config={"attention.sliding_window": "sliding_window"},
        configure=configure_olmo2,
    ),
    # Ministral 3 / Mistral 3's text model: Llama's tensors, q and k in llama.cpp's rope order
    "mistral3": Arch("ministral3", permuted=True, configure=configure_mistral3),
    # Llama 4 (Scout, Maverick; the converter writes Llama4ForCausalLM and the text model of a
    # Llama4ForConditionalGeneration alike): q/k rows as the hub's (its rope pairs (2i, 2i + 1))
    "llama4": Arch(
        "llama4_text",
        tensors=LLAMA4,
        config={
            "feed_forward_length": "intermediate_size_mlp",  # the dense layers'
            "expert_feed_forward_length": "intermediate_size",  # each expert's and the shared
            "expert_count": "num_local_experts",
            "expert_used_count": "num_experts_per_tok",
            "interleave_moe_layer_step": "interleave_moe_layer_step",
        },
        configure=configure_llama4,
    ),
    "glm4moe": Arch(
        "glm4_moe",
        tensors=GLM4MOE,
        config=GLM4MOE_KEYS,
        partial_rope=True,
        configure=configure_glm4moe,
        qk_norm_key="use_qk_norm",
    ),
    # Granite 4.0-H: Mamba2 layers (gguf_fixes.py) beside attention, q/k in llama.cpp's rope
    # order; routed experts (softmax over the top-k logits) and the shared MLP, or the shared
    # MLP alone as the dense MLP (the Micro)
    "granitehybrid": Arch(
        "granitemoehybrid",
        permuted=True,
        tensors={**EXPERTS, **GRANITE_HYBRID},
        config={**MOE_KEYS, **GRANITE_HYBRID_KEYS},
        configure=configure_granite_hybrid,
        fixes=GRANITE_HYBRID_FIXES,
    ),
    # LFM2: gated short-conv layers beside attention with q/k norms; the conv stored 2-D
    "lfm2": Arch(
        "lfm2",
        tensors=LFM2,
        config=LFM2_KEYS,
        configure=configure_lfm2,
        fixes={"blk.{}.shortconv.conv": Fix(values=lambda w: w.unsqueeze(1))},
    ),
    # Falcon-H1: attention and Mamba2 in every layer, the multipliers folded into the weights
    # (gguf_fixes.py); Mamba2's tensors and keys as Granite 4.0-H's; q/k rows as the hub's (the
    # converter's Mamba2 path does not permute them)
    "falcon-h1": Arch(
        "falcon_h1",
        tensors={**{k: v for k, v in GRANITE_HYBRID.items() if ".ssm_" in k}, **FALCON_H1_TENSORS},
        config={
            **{k: v for k, v in GRANITE_HYBRID_KEYS.items() if k.startswith("ssm.")},
            **FALCON_H1_KEYS,
        },
        configure=falcon_h1_config,
        fixes=GRANITE_HYBRID_FIXES,
    ),
    # llama.cpp's minimax-m2 graph: sigmoid scores plus the bias, renormalised; no MTP written
    "minimax-m2": Arch(
        "minimax_m2",
        tensors=MINIMAXM2,
        config={"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
        partial_rope=True,
    ),
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+ rope scaling, stored as per-frequency factors
# LongRoPE (Phi-3's 128k models): the hub's long_factor and short_factor, as float32 tensors
LONG_FACTORS, SHORT_FACTORS = "rope_factors_long.weight", "rope_factors_short.weight"
ROPE_TENSORS = (ROPE_FREQS, LONG_FACTORS, SHORT_FACTORS)  # read into the config, not weights

# {arch}.<key> -> config.json key
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
# general.file_type (llama.cpp's llama_ftype) -> torch_dtype; block formats: bfloat16
FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
