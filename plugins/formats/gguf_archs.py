"""llama.cpp's GGUF architectures, as gguf.py maps them onto hub checkpoints.

Per `general.architecture` (`ARCHITECTURES`): the hub's model_type, the file's tensor names ->
the hub's, `{arch}.*` metadata keys -> config.json keys, and what llama.cpp implies without
storing it (defaults, and `configure` functions for what takes more than a rename).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.errors import ConfigError
from plugins.formats.gguf_fixes import (
    HYBRID_KEYS,
    QWEN3_5_FIXES,
    QWEN3_5_TENSORS,
    QWEN3_NEXT_FIXES,
    QWEN3_NEXT_TENSORS,
    Fix,
    hybrid_config,
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
EXPERTS = {  # a MoE MLP's router and routed experts, under Qwen's and DeepSeek's hub names
    "blk.{}.ffn_gate_inp": "model.layers.{}.mlp.gate",
    "blk.{}.ffn_gate_exps": "model.layers.{}.mlp.experts.{e}.gate_proj",
    "blk.{}.ffn_up_exps": "model.layers.{}.mlp.experts.{e}.up_proj",
    "blk.{}.ffn_down_exps": "model.layers.{}.mlp.experts.{e}.down_proj",
}
MOE_KEYS = {
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}
MIXTRAL = {  # Mixtral's hub names: w1 gate, w3 up, w2 down
    "blk.{}.ffn_gate_inp": "model.layers.{}.block_sparse_moe.gate",
    "blk.{}.ffn_gate_exps": "model.layers.{}.block_sparse_moe.experts.{e}.w1",
    "blk.{}.ffn_up_exps": "model.layers.{}.block_sparse_moe.experts.{e}.w3",
    "blk.{}.ffn_down_exps": "model.layers.{}.block_sparse_moe.experts.{e}.w2",
}
_ATTN = "model.layers.{}.self_attn"
DEEPSEEK2 = {  # MLA's projections and norms, shared experts, the router's correction bias
    **EXPERTS,
    "blk.{}.attn_q_a": f"{_ATTN}.q_a_proj",
    "blk.{}.attn_q_a_norm": f"{_ATTN}.q_a_layernorm",
    "blk.{}.attn_q_b": f"{_ATTN}.q_b_proj",
    "blk.{}.attn_kv_a_mqa": f"{_ATTN}.kv_a_proj_with_mqa",
    "blk.{}.attn_kv_a_norm": f"{_ATTN}.kv_a_layernorm",
    "blk.{}.attn_kv_b": f"{_ATTN}.kv_b_proj",  # files converted before llama.cpp split it
    "blk.{}.ffn_gate_shexp": "model.layers.{}.mlp.shared_experts.gate_proj",
    "blk.{}.ffn_up_shexp": "model.layers.{}.mlp.shared_experts.up_proj",
    "blk.{}.ffn_down_shexp": "model.layers.{}.mlp.shared_experts.down_proj",
    "blk.{}.exp_probs_b.bias": "model.layers.{}.mlp.gate.e_score_correction_bias",  # whole name
}


DSA = {  # DeepSeek sparse attention's indexer
    **DEEPSEEK2,
    "blk.{}.indexer.attn_q_b": f"{_ATTN}.indexer.wq_b",
    "blk.{}.indexer.attn_k": f"{_ATTN}.indexer.wk",
    "blk.{}.indexer.k_norm": f"{_ATTN}.indexer.k_norm",
    "blk.{}.indexer.proj": f"{_ATTN}.indexer.weights_proj",
}


def _kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """DeepSeek's kv_b_proj (heads x (nope + v), kv_lora_rank): per head its k rows, then its v
    rows, from llama.cpp's attn_k_b (heads, kv_lora_rank, nope: the k rows transposed) and
    attn_v_b (heads, v, kv_lora_rank)."""
    import torch

    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).flatten(0, 1)


def _deepseek2(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """DeepSeek's config.json from llama.cpp's deepseek2 metadata (V2, V2-Lite, V3, R1 and
    their kin). llama.cpp writes MLA as MQA over the latent (head_count_kv 1, key_length
    kv_lora_rank + rope) and keeps the per-head sizes in *_length_mla (files converted before
    that: in key_length / value_length); it leaves out settings that are false, zero or absent
    (q_lora_rank, norm_topk_prob, ...); it stores YaRN's mscale_all_dim as 0.1 * it and runs
    mscale = mscale_all_dim; V3's MTP layer is not converted. Sigmoid router scores
    make the file a V3 (noaux_tc routing, with the correction bias); softmax ones a V2, greedy
    or, with groups, group_limited_greedy (groups ranked by their best expert, as DeepSeek's
    code does; llama.cpp's graph ranks them by their top two)."""
    gating = meta("expert_gating_func", 1)  # 1 softmax (absent in older V2 files), 2 sigmoid
    if gating not in (1, 2):
        raise ConfigError(
            f"{path}: deepseek2.expert_gating_func {gating} is not supported (DeepSeek's routers "
            "score with softmax, 1, or sigmoid, 2)"
        )
    sigmoid = gating == 2
    groups = meta("expert_group_count") or 1
    head_k = meta("attention.key_length_mla") or meta("attention.key_length")
    head_v = meta("attention.value_length_mla") or meta("attention.value_length")
    rope = meta("rope.dimension_count")
    if not (head_k and head_v and rope and meta("attention.kv_lora_rank")):
        raise ConfigError(
            f"{path}: a deepseek2 file needs the metadata keys deepseek2.attention.kv_lora_rank, "
            "deepseek2.attention.key_length(_mla), value_length(_mla) and rope.dimension_count; "
            "convert it again with a current llama.cpp"
        )
    cfg.pop("head_dim", None)
    cfg.update(
        model_type="deepseek_v3" if sigmoid else "deepseek_v2",
        num_key_value_heads=cfg.get("num_attention_heads"),  # MLA has no kv heads of its own
        q_lora_rank=meta("attention.q_lora_rank"),  # absent: a plain q_proj (V2-Lite)
        kv_lora_rank=meta("attention.kv_lora_rank"),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=head_k - rope,
        v_head_dim=head_v,
        n_routed_experts=meta("expert_count"),  # absent: every MLP dense
        n_shared_experts=meta("expert_shared_count", 0),
        first_k_dense_replace=meta("leading_dense_block_count", 0),
        moe_layer_freq=1,
        scoring_func="sigmoid" if sigmoid else "softmax",
        topk_method="noaux_tc" if sigmoid else "group_limited_greedy" if groups > 1 else "greedy",
        n_group=groups,
        topk_group=meta("expert_group_used_count") or groups,
        norm_topk_prob=bool(meta("expert_weights_norm", False)),
        routed_scaling_factor=meta("expert_weights_scale", 1.0),
        num_nextn_predict_layers=0,
    )
    log_mul = meta("rope.scaling.yarn_log_multiplier")
    if cfg.get("rope_scaling") and log_mul:
        mscale = float(str(np.float32(log_mul / 0.1)))  # the shortest decimal: 0.707
        cfg["rope_scaling"] = dict(cfg["rope_scaling"], mscale=mscale, mscale_all_dim=mscale)
    return cfg


def _dsa(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """DeepSeek V3.2's (deepseek32) and GLM-5's (glm-dsa) config.json: deepseek2's, plus the
    indexer's keys, and the MTP block the converters keep after the decoder's (not run).
    GLM-5.1+'s shared layers: indexer.types (true: the layer runs its indexer). The files do
    not say the indexer's rope layout: each family's own (transformers') applies."""
    heads, dim, top_k = (
        meta(f"attention.indexer.{k}") for k in ("head_count", "key_length", "top_k")
    )
    if not (heads and dim and top_k):
        raise ConfigError(
            f"{path}: a DSA file needs the metadata keys attention.indexer.head_count, "
            ".key_length and .top_k; convert it again with a current llama.cpp"
        )
    model_type = cfg["model_type"]  # the arch's; deepseek2's would make it a V2 / V3
    cfg = _deepseek2(meta, cfg, path)
    cfg.update(
        model_type=model_type,
        num_nextn_predict_layers=meta("nextn_predict_layers", 0),
        index_n_heads=heads,
        index_head_dim=dim,
        index_topk=top_k,
    )
    types = meta("attention.indexer.types")
    if types is not None:
        n = cfg["num_hidden_layers"]
        cfg["indexer_types"] = ["full" if t else "shared" for t in list(types)[:n]]
    return cfg


GPT_OSS = {  # transformers' names; the experts under the released checkpoint's (E, out, in) ones
    "blk.{}.post_attention_norm": "model.layers.{}.post_attention_layernorm",
    "blk.{}.attn_sinks.weight": "model.layers.{}.self_attn.sinks",
    "blk.{}.ffn_gate_inp": "model.layers.{}.mlp.router",
    # the converter splits the hub's interleaved (gate, up) rows into gate and up, MXFP4 ones
    # repacked, float ones transposed to (E, out, in), as `_blocks` are: two file tensors of one
    # hub name, their rows alternating in the keys' order
    "blk.{}.ffn_gate_exps.weight": "model.layers.{}.mlp.experts.gate_up_proj_blocks",
    "blk.{}.ffn_up_exps.weight": "model.layers.{}.mlp.experts.gate_up_proj_blocks",
    "blk.{}.ffn_gate_exps.bias": "model.layers.{}.mlp.experts.gate_up_proj_bias",
    "blk.{}.ffn_up_exps.bias": "model.layers.{}.mlp.experts.gate_up_proj_bias",
    "blk.{}.ffn_down_exps.weight": "model.layers.{}.mlp.experts.down_proj_blocks",
    "blk.{}.ffn_down_exps.bias": "model.layers.{}.mlp.experts.down_proj_bias",
}
GEMMA2_NORMS = {  # Gemma 2/3's sandwich norms: after attention, before and after the MLP
    "blk.{}.post_attention_norm": "model.layers.{}.post_attention_layernorm",
    "blk.{}.ffn_norm": "model.layers.{}.pre_feedforward_layernorm",
    "blk.{}.post_ffw_norm": "model.layers.{}.post_feedforward_layernorm",
}
GEMMA2_KEYS = {
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}


def _gemma_scale(cfg: dict[str, Any], layers_27b: int) -> dict[str, Any]:
    """Gemma 2/3's query_pre_attn_scalar, which llama.cpp's converter does not store: its loader
    takes hidden / heads for the 27B (recognised by its layer count), head_dim for every other
    size, as the releases have it (gemma_pytorch's config)."""
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    if cfg.get("num_hidden_layers") == layers_27b and hidden and heads:
        return {**cfg, "query_pre_attn_scalar": hidden // heads}
    return {**cfg, "query_pre_attn_scalar": cfg["head_dim"]} if cfg.get("head_dim") else cfg


def _gemma2(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    return _gemma_scale(cfg, 46)


def _gemma3(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """Gemma 3's scale as Gemma 2's; a file with no window has global layers only (the converter
    writes none for sliding_window_pattern 1, and llama.cpp then runs no window)."""
    cfg = _gemma_scale(cfg, 62)
    return cfg if "sliding_window" in cfg else {**cfg, "sliding_window_pattern": 1}


def _olmo2(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """OLMo 2 and OLMo 3, which llama.cpp writes both as olmo2: a file with a window is an
    OLMo 3, its window layers listed by attention.sliding_window_pattern (absent: three in
    four, transformers' default), their plain rope at rope.freq_base_swa (absent in older
    files: freq_base), the model's rope and its scaling on the full layers only. The converter
    stores YaRN's attention factor (the releases give it) as rope.scaling.yarn_attn_factor."""
    scaling = cfg.pop("rope_scaling", None)
    factor = meta("rope.scaling.yarn_attn_factor")
    if scaling and scaling["rope_type"] == "yarn" and factor:
        scaling = {**scaling, "attention_factor": factor}
    if "sliding_window" not in cfg:
        return {**cfg, "rope_scaling": scaling}
    theta = cfg.pop("rope_theta", 10000.0)
    pattern = meta("attention.sliding_window_pattern")
    if pattern is not None:
        cfg["layer_types"] = ["sliding_attention" if w else "full_attention" for w in pattern]
    full = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    local = {"rope_type": "default", "rope_theta": meta("rope.freq_base_swa") or theta}
    return {
        **cfg,
        "model_type": "olmo3",
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
    }


def _mistral3(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """Ministral 3 (and a Mistral 3's text model), which llama.cpp writes as mistral3: the
    queries' scale as attention.temperature_scale (llama_4_scaling_beta), YaRN's
    mscale_all_dim as rope.scaling.yarn_log_multiplier (mscale, which it does not store, is
    equal in the releases). A file without the scale is a plain Mistral text model (Mistral
    Small 3.1's), which loads as `mistral`."""
    beta = meta("attention.temperature_scale")
    scaling = cfg.get("rope_scaling")
    if beta is None or not scaling:
        return {**cfg, "model_type": "mistral"}
    log_mul = meta("rope.scaling.yarn_log_multiplier")
    if log_mul:
        scaling = {**scaling, "mscale": log_mul, "mscale_all_dim": log_mul}
    return {**cfg, "rope_scaling": {**scaling, "llama_4_scaling_beta": beta}}


_FF = "model.layers.{}.feed_forward"
LLAMA4 = {  # the MLP is `feed_forward`: dense, or a router, experts and one shared expert
    "blk.{}.ffn_gate": f"{_FF}.gate_proj",
    "blk.{}.ffn_up": f"{_FF}.up_proj",
    "blk.{}.ffn_down": f"{_FF}.down_proj",
    "blk.{}.ffn_gate_inp": f"{_FF}.router",
    "blk.{}.ffn_gate_exps": f"{_FF}.experts.{{e}}.gate_proj",
    "blk.{}.ffn_up_exps": f"{_FF}.experts.{{e}}.up_proj",
    "blk.{}.ffn_down_exps": f"{_FF}.experts.{{e}}.down_proj",
    "blk.{}.ffn_gate_shexp": f"{_FF}.shared_expert.gate_proj",
    "blk.{}.ffn_up_shexp": f"{_FF}.shared_expert.up_proj",
    "blk.{}.ffn_down_shexp": f"{_FF}.shared_expert.down_proj",
}


def _llama4(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """What llama.cpp's llama4 graph implies and the converter does not store: chunks of 8192
    tokens on 3 layers of 4, the 4th without rope and its queries' temperature tuned (floor
    8192, scale 0.1); q and k L2-normed unless the file has 128 experts (Maverick). Files
    without experts or chunks (sliding_window 0: MobileLLM) run otherwise there: refused."""
    if meta("attention.sliding_window") == 0 or not meta("expert_count"):
        raise ConfigError(
            f"{path}: a llama4 file without experts or with llama4.attention.sliding_window 0 "
            "(MobileLLM) is not supported; Llama 4 Scout and Maverick files are"
        )
    return {
        **cfg,
        "attention_chunk_size": 8192,
        "no_rope_layer_interval": 4,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "use_qk_norm": meta("expert_count") != 128,
    }


# GLM-4.5 / 4.6 / 4.7: DeepSeek V3's MoE under GQA; the norm before the MLP is written as
# post_attention_norm; the MTP layer (blocks past block_count - nextn_predict_layers) is not run
GLM4MOE = {
    **{k: v for k, v in DEEPSEEK2.items() if not k.startswith("blk.{}.attn_")},
    "blk.{}.post_attention_norm": "model.layers.{}.post_attention_layernorm",
}
GLM4MOE_KEYS = {
    **MOE_KEYS,
    "expert_count": "n_routed_experts",
    "expert_shared_count": "n_shared_experts",
    "leading_dense_block_count": "first_k_dense_replace",
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
    "expert_weights_scale": "routed_scaling_factor",
}
# MiniMax M2: Mixtral's expert names, the router's correction bias beside the gate
MINIMAXM2 = {
    **MIXTRAL,
    "blk.{}.exp_probs_b.bias": "model.layers.{}.block_sparse_moe.e_score_correction_bias",
}


def _glm4moe(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """GLM-4.5's flags that a zero or false value leaves out of the renames: expert_weights_norm
    (absent: false, as llama.cpp reads it), nextn_predict_layers (absent: a file converted
    without its MTP layer)."""
    norm, mtp = bool(meta("expert_weights_norm", False)), meta("nextn_predict_layers", 0)
    return {**cfg, "norm_topk_prob": norm, "num_nextn_predict_layers": mtp}


GEMMA4 = {  # Gemma 2/3's norms, the per-layer inputs, the layer scalar
    **GEMMA2_NORMS,
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
    "blk.{}.inp_gate": "model.layers.{}.per_layer_input_gate",
    "blk.{}.proj": "model.layers.{}.per_layer_projection",
    "blk.{}.post_norm": "model.layers.{}.post_per_layer_input_norm",
    "blk.{}.layer_output_scale.weight": "model.layers.{}.layer_scalar",  # whole name
    # the MoE models' router, stacked experts (E, out, in), as transformers names them
    "blk.{}.ffn_gate_inp": "model.layers.{}.router.proj",
    "blk.{}.ffn_gate_inp.scale": "model.layers.{}.router.scale",
    "blk.{}.ffn_down_exps.scale": "model.layers.{}.router.per_expert_scale",
    "blk.{}.ffn_gate_up_exps.weight": "model.layers.{}.experts.gate_up_proj",
    "blk.{}.ffn_down_exps.weight": "model.layers.{}.experts.down_proj",
    "blk.{}.post_ffw_norm_1": "model.layers.{}.post_feedforward_layernorm_1",
    "blk.{}.pre_ffw_norm_2": "model.layers.{}.pre_feedforward_layernorm_2",
    "blk.{}.post_ffw_norm_2": "model.layers.{}.post_feedforward_layernorm_2",
}
GEMMA4_KEYS = {
    **GEMMA2_KEYS,
    "expert_count": "num_experts",
    "expert_used_count": "top_k_experts",
    "expert_feed_forward_length": "moe_intermediate_size",
}


def _gemma4(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """Gemma 4's config.json from llama.cpp's gemma4 metadata: per-layer arrays where the hub
    has one value and a flag (feed_forward_length: double-wide MLPs on the K/V-sharing layers;
    head_count_kv: the global layers' own kv heads, which transformers has only with K = V),
    the window layers' head_dim in key_length_swa (key_length: the global layers'), the
    window pattern as booleans, and one rope block per layer kind."""
    windows = meta("attention.sliding_window_pattern") or []
    kinds = ["sliding_attention" if w else "full_attention" for w in windows]
    ff, kv = cfg.get("intermediate_size"), cfg.get("num_key_value_heads")
    if isinstance(ff, list):
        cfg.update(intermediate_size=ff[0], use_double_wide_mlp=any(x != ff[0] for x in ff))
    if isinstance(kv, list):
        full = kinds.index("full_attention")
        local = kinds.index("sliding_attention") if "sliding_attention" in kinds else full
        cfg.update(num_key_value_heads=kv[local], num_global_key_value_heads=kv[full])
        cfg["attention_k_eq_v"] = True
    full_rope = cfg.pop("rope_scaling", None) or {"rope_type": "default"}
    local_theta = meta("rope.freq_base_swa", 10000.0)
    return {
        **cfg,
        "layer_types": kinds,
        "head_dim": meta("attention.key_length_swa") or cfg.get("head_dim"),
        "global_head_dim": meta("attention.key_length"),
        "rope_parameters": {
            "full_attention": {**full_rope, "rope_theta": cfg.pop("rope_theta", 1e6)},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "num_kv_shared_layers": meta("attention.shared_kv_layers", 0),
        "hidden_size_per_layer_input": meta("embedding_length_per_layer_input", 0),
        "vocab_size_per_layer_input": cfg.get("vocab_size"),
        "enable_moe_block": bool(meta("expert_count")),
    }


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
    "deepseek2": Arch(
        "deepseek_v2",
        tensors=DEEPSEEK2,
        config={
            "expert_used_count": "num_experts_per_tok",
            "expert_feed_forward_length": "moe_intermediate_size",
        },
        joins={f"{_ATTN}.kv_b_proj": Join(("blk.{}.attn_k_b", "blk.{}.attn_v_b"), _kv_b)},
        configure=_deepseek2,
    ),
    # DeepSeek V3.2 and GLM-5: deepseek2 plus DSA's indexer (its model_type: from the arch)
    "deepseek32": Arch(
        "deepseek_v32",
        tensors=DSA,
        config={
            "expert_used_count": "num_experts_per_tok",
            "expert_feed_forward_length": "moe_intermediate_size",
        },
        joins={f"{_ATTN}.kv_b_proj": Join(("blk.{}.attn_k_b", "blk.{}.attn_v_b"), _kv_b)},
        configure=_dsa,
    ),
    "glm-dsa": Arch(
        "glm_moe_dsa",
        tensors=DSA,
        config={
            "expert_used_count": "num_experts_per_tok",
            "expert_feed_forward_length": "moe_intermediate_size",
        },
        joins={f"{_ATTN}.kv_b_proj": Join(("blk.{}.attn_k_b", "blk.{}.attn_v_b"), _kv_b)},
        configure=_dsa,
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
        configure=_gemma2,
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
        configure=_gemma3,
    ),
    # Gemma 4 (E2B, E4B, 31B, 26B-A4B): norms stored as they are (w, not 1 + w); what differs
    # from gemma3 in its metadata is read by _gemma4
    "gemma4": Arch(
        "gemma4_text",
        tensors=GEMMA4,
        config=GEMMA4_KEYS,
        configure=_gemma4,
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
    # OLMo 2 / 3: norms after attention and after the MLP only (no attn_norm nor ffn_norm)
    "olmo2": Arch(
        "olmo2",
        tensors={
            "blk.{}.post_attention_norm": "model.layers.{}.post_attention_layernorm",
            "blk.{}.post_ffw_norm": "model.layers.{}.post_feedforward_layernorm",
        },
        config={"attention.sliding_window": "sliding_window"},
        configure=_olmo2,
    ),
    # Ministral 3 / Mistral 3's text model: Llama's tensors, q and k in llama.cpp's rope order
    "mistral3": Arch("ministral3", permuted=True, configure=_mistral3),
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
        configure=_llama4,
    ),
    "glm4moe": Arch(
        "glm4_moe",
        tensors=GLM4MOE,
        config=GLM4MOE_KEYS,
        partial_rope=True,
        configure=_glm4moe,
        qk_norm_key="use_qk_norm",
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
