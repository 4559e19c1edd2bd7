"""The GGUF checkpoint format (llama.cpp's single-file models), read with the `gguf` package.

The file is presented to the core as if it were a hub folder: `config()` is a config.json built
from the `{arch}.*` metadata, tensor names are the hub's (`blk.0.attn_q.weight` ->
`model.layers.0.self_attn.q_proj.weight`), tensors come back as floats or, for linear weights,
as their blocks repacked (`read_quantized`, plugins/gguf_quant.py), and the tokenizer is
rebuilt from the vocabulary (see plugins/gguf_tokenizer.py). llama.cpp stores Llama's q/k rows
permuted for its rope kernel, and Gemma's (1 + w) norm weights as 1 + w; `read()` undoes both (the
permutation exactly as transformers' GGUF loader does). A hub tensor llama.cpp splits (DeepSeek's
MLA `kv_b_proj`) is joined back on read (`Join`); where it split one hub tensor's rows in two
(gpt-oss's interleaved gate_up), both file tensors carry the hub's name and `read()` interleaves
their rows again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.errors import CheckpointError, ConfigError
from core.hookspecs import hookimpl
from plugins.gguf_reader import GGUFFile

if TYPE_CHECKING:  # torch loads only when a model is built: listing plugins stays light
    import torch

    from kernels.qweight import QuantWeight


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


def hub_names(name: str, tensors: dict[str, str], experts: int = 0) -> list[tuple[str, int | None]]:
    """`blk.3.attn_q.weight` -> [(`model.layers.3.self_attn.q_proj.weight`, None)]; a stack of
    experts -> [(expert e's hub name, e) for each of the `experts`]."""
    key, layer, leaf = _template(name)
    if f"{key}.{leaf}" in tensors:  # a whole name: the hub's leaf is not the file's
        return [(tensors[f"{key}.{leaf}"].format(*layer), None)]
    target = tensors.get(key)
    if target is None:
        return [(name, None)]
    if "{e}" not in target:
        return [(f"{target.format(*layer)}.{leaf}", None)]
    return [(f"{target.format(*layer, e=e)}.{leaf}", e) for e in range(experts)]


def _template(name: str) -> tuple[str, list[str], str]:
    """`blk.3.attn_q.weight` -> (`blk.{}.attn_q`, ["3"], `weight`)."""
    module, _, leaf = name.rpartition(".")
    parts = module.split(".")
    key = ".".join("{}" if p.isdigit() else p for p in parts)
    return key, [p for p in parts if p.isdigit()], leaf


def _rows(name: str) -> int:
    """The axis of a file tensor's rows, which interleaving alternates (row i of part k of n
    becomes row i * n + k): a weight's -2, a bias's -1."""
    return -1 if name.endswith(".bias") else -2


class GGUFCheckpoint:
    def __init__(self, path: Path):
        self.path = path
        self.file = GGUFFile(path)
        meta = self.file.metadata
        if int(meta.get("split.count", 1)) > 1:
            raise CheckpointError(
                f"{path}: is one of {meta['split.count']} split GGUF files; merge them first "
                "with llama.cpp's `llama-gguf-split --merge`"
            )
        self.arch = str(meta.get("general.architecture", ""))
        if not self.arch:
            raise ConfigError(f"{path}: GGUF metadata lacks 'general.architecture'")
        if self.arch not in ARCHITECTURES:
            raise ConfigError(
                f"{path}: GGUF architecture {self.arch!r} is not supported; Zoo reads GGUF files "
                f"of {', '.join(sorted(ARCHITECTURES))} (other checkpoints of a built-in family "
                "load from their safetensors folder or hub repo)"
            )
        self.spec = ARCHITECTURES[self.arch]
        experts = int(self._meta("expert_count", 0) or 0)
        if experts and self.spec.moe is not None:
            self.spec = self.spec.moe
        tensors = {**TENSOR_NAMES, **self.spec.tensors}
        self._names: dict[str, str] = {}  # hub name -> the file's (the first, of several)
        self._interleaved: dict[str, list[str]] = {}  # hub name -> the file's, rows alternating
        self._expert: dict[str, int] = {}  # hub name -> its expert's index in a stacked tensor
        part_of = {p: hub for hub, j in self.spec.joins.items() for p in j.parts}
        self._joined: dict[str, tuple[Join, dict[str, str]]] = {}  # hub -> (join, part -> file's)
        for n in self.file.tensors:
            if n in ROPE_TENSORS:
                continue
            key, layer, leaf = _template(n)
            if key in part_of:
                hub = f"{part_of[key].format(*layer)}.{leaf}"
                self._joined.setdefault(hub, (self.spec.joins[part_of[key]], {}))[1][key] = n
                continue
            for hub, e in hub_names(n, tensors, experts):
                self._interleaved.setdefault(hub, []).append(n)
                if e is not None:
                    self._expert[hub] = e
        order = list(tensors)
        for hub, files in list(self._interleaved.items()):
            if len(files) > 1:  # in the order of their keys (whole names, as gpt-oss's are)
                files.sort(key=lambda n: order.index("{}.{}".format(*_template(n)[::2])))
            else:
                del self._interleaved[hub]
            self._names[hub] = files[0]
        for join, found in self._joined.values():
            missing = [p for p in join.parts if p not in found]
            if missing:
                first = next(iter(found.values()))
                _, layer, leaf = _template(first)
                partner = f"{missing[0].format(*layer)}.{leaf}"
                raise CheckpointError(
                    f"{path}: tensor {first!r} comes with {partner!r}, which the file lacks; "
                    "it is incomplete: convert or download it again"
                )
        self._config: dict[str, Any] | None = None

    def _meta(self, key: str, default: Any = None) -> Any:
        return self.file.metadata.get(f"{self.arch}.{key}", default)

    def config(self) -> dict[str, Any]:
        if self._config is None:
            self._config = self._build_config()
        return self._config

    def _build_config(self) -> dict[str, Any]:
        meta = self.file.metadata
        cfg: dict[str, Any] = {"model_type": self.spec.model_type, **self.spec.defaults}
        keys = {**CONFIG_KEYS, **self.spec.config}
        cfg.update({hub: self._meta(key) for key, hub in keys.items() if self._meta(key)})
        rope_dim = self._meta("rope.dimension_count")
        if self.spec.partial_rope and rope_dim:
            cfg["partial_rotary_factor"] = rotary_factor(rope_dim, cfg)
        elif "head_dim" not in cfg and rope_dim:
            cfg["head_dim"] = rope_dim  # as transformers reads it
        if "vocab_size" not in cfg:  # older files: the vocabulary's or the embedding's length
            embd = self.file.tensors.get("token_embd.weight")
            cfg["vocab_size"] = len(meta.get("tokenizer.ggml.tokens") or ()) or (
                embd.shape[0] if embd else None
            )
        cfg["rope_scaling"] = self._rope_scaling(cfg)
        cfg["tie_word_embeddings"] = "output.weight" not in self.file.tensors
        cfg["attention_bias"] = "blk.0.attn_q.bias" in self.file.tensors
        cfg["torch_dtype"] = FILE_DTYPES.get(meta.get("general.file_type"), "bfloat16")
        gen = self.generation_config()
        cfg.update({k: v for k, v in gen.items() if k in ("bos_token_id", "eos_token_id")})
        cfg = {k: v for k, v in cfg.items() if v is not None}
        return self.spec.configure(self._meta, cfg, self.path) if self.spec.configure else cfg

    def _rope_scaling(self, cfg: dict[str, Any]) -> dict[str, Any] | None:
        kind = self._meta("rope.scaling.type")
        if LONG_FACTORS in self.file.tensors and kind in (None, "none", "longrope"):
            return self._longrope(cfg)
        if kind in ("linear", "yarn"):
            out = {"rope_type": kind, **self.spec.rope_scaling}
            out["factor"] = self._meta("rope.scaling.factor")
            if self._meta("rope.scaling.original_context_length"):
                out["original_max_position_embeddings"] = self._meta(
                    "rope.scaling.original_context_length"
                )
            for key in ("beta_fast", "beta_slow"):
                if self._meta(f"rope.scaling.yarn_{key}"):
                    out[key] = self._meta(f"rope.scaling.yarn_{key}")
            return out
        if kind not in (None, "none"):
            raise ConfigError(f"{self.path}: unsupported {self.arch}.rope.scaling.type {kind!r}")
        if ROPE_FREQS not in self.file.tensors:
            return None
        heads = cfg.get("num_attention_heads") or 1  # missing fields fail validation later
        dim = self._meta("rope.dimension_count") or cfg.get("head_dim")
        dim = dim or cfg.get("hidden_size", 0) // heads
        factors = self.file.read(ROPE_FREQS).double().numpy()
        return llama3_rope_scaling(factors, cfg.get("rope_theta", 10000.0), dim, self.path)

    def _longrope(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """LongRoPE's parameters: the factors as stored (float32, each read as the float64 it
        is: Phi-3's hub configs spell them so), the original length, and the attention factor
        where it is not the one the lengths imply (llama.cpp's converter writes that one)."""
        if SHORT_FACTORS not in self.file.tensors:
            raise CheckpointError(
                f"{self.path}: has {LONG_FACTORS} but no {SHORT_FACTORS}; LongRoPE needs both "
                "(convert the checkpoint again with llama.cpp's convert_hf_to_gguf.py)"
            )
        out: dict[str, Any] = {"rope_type": "longrope"}
        for key, name in (("long_factor", LONG_FACTORS), ("short_factor", SHORT_FACTORS)):
            out[key] = self.file.read(name).double().tolist()
        length = cfg.get("max_position_embeddings") or 1  # missing: fails validation later
        orig = out["original_max_position_embeddings"] = (
            cfg.get("original_max_position_embeddings") or length
        )
        stored = self._meta("rope.scaling.attn_factor")
        scale = length / orig
        implied = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
        if stored and np.float32(stored) != np.float32(implied):
            out["attention_factor"] = stored
        return out

    def generation_config(self) -> dict[str, Any]:
        meta = self.file.metadata
        eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        eos = list(dict.fromkeys(i for i in eos if i is not None))  # in order, once each
        out: dict[str, Any] = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id")}
        out["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        return {k: v for k, v in out.items() if v is not None}

    def tensor_names(self) -> list[str]:
        return [*self._names, *self._joined]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._joined:  # joined on the meta device: shapes, no data
            import torch

            parts = [
                torch.empty(self.file.tensors[n].shape, device="meta") for n in self._parts(name)
            ]
            return tuple(self._joined[name][0].join(*parts).shape)
        shape = list(self.file.tensors[self._names[name]].shape)
        if name in self._interleaved:
            shape[_rows(self._names[name])] *= len(self._interleaved[name])
        return tuple(shape[1:] if name in self._expert else shape)

    def read(self, name: str) -> torch.Tensor:
        import torch

        if name in self._joined:
            return self._joined[name][0].join(*(self.file.read(n) for n in self._parts(name)))
        e = self._expert.get(name)
        if name in self._interleaved:
            parts = [self.file.read(n, e) for n in self._interleaved[name]]
            return torch.stack(parts, _rows(self._names[name])).reshape(self.shape(name))
        w = self.file.read(self._names[name], e)
        if self.spec.norm_offset and name.endswith("norm.weight"):  # as the converter added it
            w = w.float() - self.spec.norm_offset
        return self._unpermuted(name, w)

    def _parts(self, name: str) -> list[str]:
        """The file's tensors that a joined hub tensor is made of, in the join's order."""
        join, found = self._joined[name]
        return [found[p] for p in join.parts]

    def _files(self, name: str) -> list[str]:
        """The file's tensors that make the hub's `name`: one, or those interleaved."""
        return self._interleaved.get(name) or [self._names[name]]

    def stored_name(self, name: str) -> str:
        """The file's own name for a tensor (`output.weight` for `lm_head.weight`; one expert
        of a stack: `blk.0.ffn_up_exps.weight[5]`; joined or interleaved: `a + b`)."""
        if name in self._joined:
            return " + ".join(self._parts(name))
        e = self._expert.get(name)
        return " + ".join(n + ("" if e is None else f"[{e}]") for n in self._files(name))

    def quant_format(self, name: str) -> str | None:
        """The tensor's block format (`q4_k`, `mxfp4`), or None for floats (F32, F16, BF16), for
        joined tensors and for interleaved ones stored in different formats (read as floats)."""
        if name in self._joined:
            return None
        kinds = {self.file.type_name(n).lower() for n in self._files(name)}
        return None if len(kinds) > 1 or kinds <= {"f32", "f16", "bf16"} else kinds.pop()

    def blocks(self, name: str) -> tuple[str, np.ndarray, np.ndarray | None]:
        """The tensor's block format, its bytes as stored ((rows, bytes per row) uint8, memory-
        mapped; a copy where interleaved) and the stored row of each row of the hub's tensor
        (None: the same order)."""
        import torch

        info = self.file.tensors[self._names[name]]
        order = None
        if self._permuted(name):
            order = self._unpermuted(name, torch.arange(info.shape[0])).numpy()
        return self.quant_format(name), self._raw(name), order

    def stored_bytes(self, name: str) -> int:
        """The tensor's bytes in the file (its blocks, or floats)."""
        infos = [self.file.tensors[n] for n in self._files(name)]
        return sum(i.nbytes // i.shape[0] if name in self._expert else i.nbytes for i in infos)

    def release(self, name: str) -> None:
        """The tensor's pages may leave this process's resident memory (their blocks were
        copied); see GGUFFile.release."""
        for n in self._files(name):
            self.file.release(n)

    def read_quantized(self, name: str) -> QuantWeight:
        """The tensor's blocks as a `QuantWeight` (lossless; see plugins/gguf_quant.py)."""
        import torch

        from plugins.gguf_quant import repack

        raw = torch.from_numpy(np.array(self._raw(name)))  # (rows, bytes per row)
        raw = self._unpermuted(name, raw).numpy()
        return repack(self.quant_format(name), raw, self.shape(name))

    def _raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (its expert's, of a stack), memory-mapped; interleaved
        ones (a matrix's rows of blocks: weights only) copied into the hub's row order. MXFP4's
        are ggml's `block_mxfp4` (an e8m0 scale byte, then 16 bytes: value j in the low nibble,
        j + 16 in the high one), which the CPU kernels keep as they are."""
        raws = [self.file.raw(n) for n in self._files(name)]
        if name in self._expert:
            raws = [raw[self._expert[name]] for raw in raws]
        if len(raws) == 1:
            return raws[0]
        return np.stack(raws, -2).reshape(*raws[0].shape[:-2], -1, raws[0].shape[-1])

    def _permuted(self, name: str) -> bool:
        """Whether llama.cpp stored this tensor's rows in its own q/k order."""
        gguf_name = self._names[name]
        return self.spec.permuted and (".attn_q." in gguf_name or ".attn_k." in gguf_name)

    def _unpermuted(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """Undo llama.cpp's q/k row order (rows are whole: floats or a row's blocks alike)."""
        gguf_name = self._names[name]
        if self._permuted(name):
            cfg = self.config()
            heads = cfg["num_attention_heads"]
            if ".attn_k." in gguf_name:
                heads = cfg.get("num_key_value_heads", heads)
            w = unpermute(w, heads)
        return w

    def tokenizer(self):
        from plugins.gguf_tokenizer import build_tokenizer

        return build_tokenizer(self.file.metadata, self.path)

    def close(self) -> None:
        self.file.close()


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `LlamaModel.permute`: each head's rows were reordered from the hub's
    (2 halves, d/2) rotary layout to interleaved pairs (d/2, 2); swap them back."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def rotary_factor(rope_dim: int, cfg: dict[str, Any]) -> float:
    """partial_rotary_factor of `rope_dim` roped dims per head: the hub's factor f gives
    int(head_dim * f) of them, so the smallest f that gives `rope_dim` (1.0: all)."""
    heads = cfg.get("num_attention_heads") or 1  # missing fields fail validation later
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 0) // heads
    if not head_dim or rope_dim >= head_dim:
        return 1.0
    f = rope_dim / head_dim
    while int(head_dim * f) < rope_dim:  # a quotient a rounding below (1 / 49 * 49 < 1)
        f = math.nextafter(f, 1.0)
    return f


def llama3_rope_scaling(
    factors: np.ndarray, theta: float, dim: int, path: Path
) -> dict[str, Any] | None:
    """The `rope_type: llama3` parameters behind llama.cpp's `rope_freqs` tensor.

    llama.cpp divides each rope frequency by a factor: 1 at high frequencies, `factor` at low
    ones, and 1 / ((1 - s) / factor + s) in between, with s linear in 1 / wavelength. Only that
    line matters, so low_freq_factor is fixed at 1 and the rest fitted; the result is checked.
    """
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    s = (1 / factors - 1 / factor) / (1 - 1 / factor)  # 1: high frequency, 0: low
    mid = (s > 1e-4) & (s < 1 - 1e-4)
    lo, hi = 1.0, 4.0  # Llama 3.x's values, kept unless the smooth band says otherwise
    if mid.sum() >= 2:  # s = (L / wavelen - lo) / (hi - lo)
        slope, icpt = np.polyfit(1 / wavelen[mid], s[mid], 1)
        hi, orig = 1 - 1 / icpt, -slope / icpt
    elif mid.any():
        orig = float(np.median(wavelen[mid] * (lo + s[mid] * (hi - lo))))
    else:  # any length between the last unscaled and the first fully scaled wavelength
        orig = float(np.sqrt(hi * wavelen[s >= 1].max(initial=1.0) * wavelen[s <= 0].min()))
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": lo,
        "high_freq_factor": float(hi),
        "original_max_position_embeddings": round(orig),
    }
    if not np.allclose(_llama3_factors(params, wavelen), factors, rtol=1e-3):
        raise ConfigError(
            f"{path}: {ROPE_FREQS} holds rope frequency factors that match no llama3 rope "
            "scaling; this kind of rope scaling is not supported"
        )
    return params


def _llama3_factors(p: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    """What llama.cpp's converter writes for these llama3 parameters (convert_hf_to_gguf.py)."""
    orig, lo, hi = (
        p["original_max_position_embeddings"],
        p["low_freq_factor"],
        p["high_freq_factor"],
    )
    s = np.clip((orig / wavelen - lo) / (hi - lo), 0.0, 1.0)
    return 1 / ((1 - s) / p["factor"] + s)


def _detect(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


@hookimpl
def zoo_register_formats(registry):
    registry.add_format("gguf", detect=_detect, open=GGUFCheckpoint)
