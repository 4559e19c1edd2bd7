"""Each llama.cpp architecture's tensor names and metadata keys beyond the common ones, and
the `configure` functions that read what a file implies beyond renames (gguf_archs.py's
`ARCHITECTURES` puts them together per `general.architecture`): each takes (meta(key, default),
the config so far, the file's path) and returns the config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.errors import ConfigError

if TYPE_CHECKING:
    import torch


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
ATTN = "model.layers.{}.self_attn"
DEEPSEEK2 = {  # MLA's projections and norms, shared experts, the router's correction bias
    **EXPERTS,
    "blk.{}.attn_q_a": f"{ATTN}.q_a_proj",
    "blk.{}.attn_q_a_norm": f"{ATTN}.q_a_layernorm",
    "blk.{}.attn_q_b": f"{ATTN}.q_b_proj",
    "blk.{}.attn_kv_a_mqa": f"{ATTN}.kv_a_proj_with_mqa",
    "blk.{}.attn_kv_a_norm": f"{ATTN}.kv_a_layernorm",
    "blk.{}.attn_kv_b": f"{ATTN}.kv_b_proj",  # files converted before llama.cpp split it
    "blk.{}.ffn_gate_shexp": "model.layers.{}.mlp.shared_experts.gate_proj",
    "blk.{}.ffn_up_shexp": "model.layers.{}.mlp.shared_experts.up_proj",
    "blk.{}.ffn_down_shexp": "model.layers.{}.mlp.shared_experts.down_proj",
    "blk.{}.exp_probs_b.bias": "model.layers.{}.mlp.gate.e_score_correction_bias",  # whole name
}


DSA = {  # DeepSeek sparse attention's indexer
    **DEEPSEEK2,
    "blk.{}.indexer.attn_q_b": f"{ATTN}.indexer.wq_b",
    "blk.{}.indexer.attn_k": f"{ATTN}.indexer.wk",
    "blk.{}.indexer.k_norm": f"{ATTN}.indexer.k_norm",
    "blk.{}.indexer.proj": f"{ATTN}.indexer.weights_proj",
}


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """DeepSeek's kv_b_proj (heads x (nope + v), kv_lora_rank): per head its k rows, then its v
    rows, from llama.cpp's attn_k_b (heads, kv_lora_rank, nope: the k rows transposed) and
    attn_v_b (heads, v, kv_lora_rank)."""
    import torch

    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).flatten(0, 1)


def configure_deepseek2(
    meta: Callable[..., Any], cfg: dict[str, Any], path: Path
) -> dict[str, Any]:
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


def configure_dsa(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
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
    cfg = configure_deepseek2(meta, cfg, path)
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


def configure_gemma2(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    return _gemma_scale(cfg, 46)


def configure_gemma3(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """Gemma 3's scale as Gemma 2's; a file with no window has global layers only (the converter
    writes none for sliding_window_pattern 1, and llama.cpp then runs no window)."""
    cfg = _gemma_scale(cfg, 62)
    return cfg if "sliding_window" in cfg else {**cfg, "sliding_window_pattern": 1}


def configure_olmo2(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
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


def configure_mistral3(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
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


def configure_llama4(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
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


def configure_glm4moe(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
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


def configure_gemma4(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
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


# --- Granite 4.0-H (`granitehybrid`): Mamba2 layers beside attention ------------------------
_L = "model.layers.{}"
GRANITE_HYBRID = {  # beside TENSOR_NAMES, EXPERTS and the shared expert's DEEPSEEK2 names
    **{k: v for k, v in DEEPSEEK2.items() if "shexp" in k},
    "blk.{}.ssm_in": f"{_L}.mamba.in_proj",
    "blk.{}.ssm_conv1d": f"{_L}.mamba.conv1d",  # weight (squeezed: see the fixes) and bias
    "blk.{}.ssm_dt.bias": f"{_L}.mamba.dt_bias",  # whole names
    "blk.{}.ssm_a": f"{_L}.mamba.A_log",
    "blk.{}.ssm_d": f"{_L}.mamba.D",
    "blk.{}.ssm_norm": f"{_L}.mamba.norm",
    "blk.{}.ssm_out": f"{_L}.mamba.out_proj",
}
GRANITE_HYBRID_KEYS = {
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
    "expert_shared_feed_forward_length": "shared_intermediate_size",
    "ssm.conv_kernel": "mamba_d_conv",
    "ssm.state_size": "mamba_d_state",
    "ssm.group_count": "mamba_n_groups",
    "ssm.time_step_rank": "mamba_n_heads",  # the converter's name for the SSM heads
}


def configure_granite_hybrid(
    meta: Callable[..., Any], cfg: dict[str, Any], path: Path
) -> dict[str, Any]:
    """Granite 4.0-H: which layers attend (head_count_kv per layer, 0 on Mamba2 layers), the
    Mamba2 head width from ssm.inner_size, the experts (0: the dense Micro), and rope only
    where llama.cpp runs it (rope.scaling.finetuned: the converter leaves it off for every
    hybrid, whatever position_embedding_type says)."""
    kv = meta("attention.head_count_kv")
    kv = list(kv) if isinstance(kv, list | tuple | np.ndarray) else [kv] * cfg["num_hidden_layers"]
    if not any(kv):  # llama.cpp's graph would take every layer for Mamba2 and miss tensors
        raise ConfigError(
            f"{path}: granitehybrid.attention.head_count_kv is 0 on every layer, so the file has "
            'no attention layer; llama.cpp\'s converter finds them by layer_types "attention" '
            'and skips transformers 5\'s "full_attention": convert again from a config.json '
            'whose layer_types say "mamba" / "attention" (as IBM\'s repos do)'
        )
    cfg["num_key_value_heads"] = max(int(n) for n in kv)
    cfg["layer_types"] = ["attention" if n else "mamba" for n in kv]
    inner, heads = meta("ssm.inner_size"), meta("ssm.time_step_rank")
    if inner and heads:
        cfg["mamba_d_head"] = inner // heads
        cfg["mamba_expand"] = inner // cfg["hidden_size"]
    cfg["num_local_experts"] = int(meta("expert_count", 0) or 0)
    cfg["num_experts_per_tok"] = int(meta("expert_used_count", 0) or 0)
    cfg["position_embedding_type"] = "rope" if meta("rope.scaling.finetuned") else "nope"
    return cfg


# --- LFM2 (`lfm2`): gated short convs beside attention -------------------------------------
_LFM2 = "model.layers.{}"
LFM2 = {  # LFM2's hub names; its final norm is stored as token_embd_norm
    "token_embd_norm": "model.embedding_norm",
    "blk.{}.attn_norm": f"{_LFM2}.operator_norm",
    "blk.{}.ffn_norm": f"{_LFM2}.ffn_norm",
    "blk.{}.attn_output": f"{ATTN}.out_proj",
    "blk.{}.attn_q_norm": f"{ATTN}.q_layernorm",
    "blk.{}.attn_k_norm": f"{ATTN}.k_layernorm",
    "blk.{}.shortconv.conv": f"{_LFM2}.conv.conv",  # (hidden, L): the hub's (hidden, 1, L)
    "blk.{}.shortconv.in_proj": f"{_LFM2}.conv.in_proj",
    "blk.{}.shortconv.out_proj": f"{_LFM2}.conv.out_proj",
    "blk.{}.ffn_gate": f"{_LFM2}.feed_forward.w1",
    "blk.{}.ffn_up": f"{_LFM2}.feed_forward.w3",
    "blk.{}.ffn_down": f"{_LFM2}.feed_forward.w2",
}
LFM2_KEYS = {
    "shortconv.l_cache": "conv_L_cache",
    "attention.layer_norm_rms_epsilon": "norm_eps",
}


def configure_lfm2(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """LFM2: the converter stores the kv heads per layer, 0 on the conv layers (which gives
    the layer pattern), and the MLP width already derived (feed_forward_length: no
    auto-adjust on read)."""
    kv = cfg.get("num_key_value_heads")
    if isinstance(kv, list):
        cfg["layer_types"] = ["full_attention" if n else "conv" for n in kv]
        cfg["num_key_value_heads"] = max(kv)
    return {**cfg, "block_auto_adjust_ff_dim": False}
