"""What llama.cpp's converter (`convert_hf_to_gguf.py`) changes in a tensor beyond its name,
undone on read by gguf.py: a `Fix` per file tensor (`Arch.fixes`). Here: the Fix and
the tables of Qwen's hybrids, Qwen3-Next and Qwen3.5 (dense and MoE), with their config.

What the converter does to those (conversion/qwen.py: `Qwen3NextModel`,
`_LinearAttentionVReorderBase`, `_QwenMtpMixin`):
- every (1 + w) RMSNorm weight is stored as 1 + w (`Arch.norm_offset`), but the gated DeltaNet
  norm, plain w;
- A_log is stored as A = -exp(A_log) (`ssm_a`), dt_bias as `ssm_dt.bias`, the conv1d weight
  squeezed to (channels, kernel);
- Qwen3-Next's in_proj_qkvz (rows grouped per key head: q | k | v | z) is split into `attn_qkv`
  (q | k | v, each over all heads) and `attn_gate` (z) (converters before llama.cpp PR 18683,
  January 2026, stored it as is, `ssm_in`); in_proj_ba is stored as is (`ssm_ba`);
- Qwen3.5's value heads, grouped by key head in the hub (k0: v0 v1, k1: v0 v1), are stored
  tiled (v0: k0 k1, v1: k0 k1) wherever they appear: v's rows of in_proj_qkv and the conv,
  in_proj_z, in_proj_b / a, A_log, dt_bias, and out_proj's columns;
- the multi-token-prediction weights (mtp.*) become blocks after the model's (`nextn`).
And llama.cpp's quantizer writes the shared expert's gate, (1, hidden) in the hub, as a vector
(a Qwen3.5 Q4_K_M download's `ffn_gate_inp_shexp` is [hidden]).
The rows a Fix moves stay whole, so its tensor keeps its blocks; so do columns moved in whole
blocks (out_proj's value heads of 128 in Q8_0's blocks of 32, not in Q4_K's of 256).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    import torch


@dataclass(frozen=True)
class Fix:
    """How the converter changed one tensor, all of it (not `Arch.norm_offset` too), undone on
    read. `rows(cfg)` / `cols(cfg)`: for each row (column) of the hub's tensor, the stored one
    it is (cfg: the hub config built from the metadata); `values(w)`: the hub's floats from the
    stored ones (such a tensor is read as floats, not kept quantized); `fused`: file tensors
    (templates, no leaf) whose rows follow this one's in the hub's tensor (the converter split
    the hub's in several)."""

    rows: Callable[[dict[str, Any]], np.ndarray] | None = None
    cols: Callable[[dict[str, Any]], np.ndarray] | None = None
    values: Callable[[torch.Tensor], torch.Tensor] | None = None
    fused: tuple[str, ...] = ()

    def floats(self, w: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
        """The hub's floats from the stored ones (its parts' rows stacked)."""
        import torch

        if self.rows is not None:
            w = w[torch.from_numpy(self.rows(cfg))]
        if self.cols is not None:
            w = w[:, torch.from_numpy(self.cols(cfg))]
        return w if self.values is None else self.values(w)

    def shape(self, stored: list[int]) -> list[int]:
        """The hub's shape of a tensor stored in this one (the values' on the meta device)."""
        import torch

        if self.values is None:
            return stored
        return list(self.values(torch.empty(stored, device="meta")).shape)

    def block_order(self, cfg: dict[str, Any], ggml_type: int) -> np.ndarray | None:
        """`cols` as whole blocks of the type moved within each row: the stored block of each
        block; None where no columns move, or they move within blocks (or the type is floats)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if self.cols is None:
            return None
        size = GGML_QUANT_SIZES.get(GGMLQuantizationType(ggml_type), (1,))[0]
        blocks = self.cols(cfg).reshape(-1, size)
        first = blocks[:, :1]
        if size == 1 or (first % size).any() or (blocks != first + np.arange(size)).any():
            return None
        return first[:, 0] // size

    def keeps_blocks(self, cfg: dict[str, Any], ggml_type: int) -> bool:
        """Whether the tensor's blocks can be kept: its values as stored, whole rows moved,
        columns (if any) by whole blocks."""
        moved = self.cols is None or self.block_order(cfg, ggml_type) is not None
        return self.values is None and moved


# --- Qwen3-Next, Qwen3.5 ---------------------------------------------------------------------
_L = "model.layers.{}"
HYBRID_TENSORS = {  # beside TENSOR_NAMES and EXPERTS (file template -> the text model's names)
    "blk.{}.post_attention_norm": f"{_L}.post_attention_layernorm",
    "blk.{}.ssm_a": f"{_L}.linear_attn.A_log",  # whole names
    "blk.{}.ssm_dt.bias": f"{_L}.linear_attn.dt_bias",
    "blk.{}.ssm_conv1d": f"{_L}.linear_attn.conv1d",
    "blk.{}.ssm_norm": f"{_L}.linear_attn.norm",
    "blk.{}.ssm_out": f"{_L}.linear_attn.out_proj",
    "blk.{}.ffn_gate_inp_shexp": f"{_L}.mlp.shared_expert_gate",
    "blk.{}.ffn_gate_shexp": f"{_L}.mlp.shared_expert.gate_proj",
    "blk.{}.ffn_up_shexp": f"{_L}.mlp.shared_expert.up_proj",
    "blk.{}.ffn_down_shexp": f"{_L}.mlp.shared_expert.down_proj",
}
QWEN3_NEXT_TENSORS = {
    **HYBRID_TENSORS,
    "blk.{}.attn_qkv": f"{_L}.linear_attn.in_proj_qkvz",  # with attn_gate: see the fixes
    "blk.{}.ssm_in": f"{_L}.linear_attn.in_proj_qkvz",  # as is: converters before 2026-01
    "blk.{}.ssm_ba": f"{_L}.linear_attn.in_proj_ba",
}
QWEN3_5_TENSORS = {
    **HYBRID_TENSORS,
    "blk.{}.attn_qkv": f"{_L}.linear_attn.in_proj_qkv",
    "blk.{}.attn_gate": f"{_L}.linear_attn.in_proj_z",
    "blk.{}.ssm_beta": f"{_L}.linear_attn.in_proj_b",
    "blk.{}.ssm_alpha": f"{_L}.linear_attn.in_proj_a",
}
HYBRID_KEYS = {  # {arch}.key -> config.json key
    "ssm.conv_kernel": "linear_conv_kernel_dim",
    "ssm.state_size": "linear_key_head_dim",
    "ssm.group_count": "linear_num_key_heads",
    "ssm.time_step_rank": "linear_num_value_heads",
    "full_attention_interval": "full_attention_interval",
    "expert_count": "num_experts",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}


def hybrid_config(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """The fields the converter stores in other terms: the value heads' width (ssm.inner_size
    is all of them) and which layers are linear (attention.recurrent_layers, which also lists
    the multi-token-prediction blocks after the model's)."""
    if meta("ssm.inner_size") and meta("ssm.time_step_rank"):
        cfg["linear_value_head_dim"] = meta("ssm.inner_size") // meta("ssm.time_step_rank")
    if recurrent := meta("attention.recurrent_layers"):
        kinds = ["linear_attention" if r else "full_attention" for r in recurrent]
        cfg["layer_types"] = kinds[: cfg.get("num_hidden_layers")]
    return cfg


def _heads(cfg: dict[str, Any]) -> tuple[int, int, int, int]:
    """(key heads, value heads per key head, key head dim, value head dim)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    return nk, nv // nk, cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]


def grouped(cfg: dict[str, Any], dim: int) -> np.ndarray:
    """Value heads of `dim` rows each, from the converter's tiled order back to the hub's
    grouped one: hub head (k, j) is stored head (j, k)."""
    nk, r, _, _ = _heads(cfg)
    return np.arange(nk * r * dim).reshape(r, nk, dim).transpose(1, 0, 2).reshape(-1)


def _qkv_grouped(cfg: dict[str, Any]) -> np.ndarray:
    """q | k as stored, then the value heads regrouped (in_proj_qkv's rows, the conv's)."""
    nk, _, dk, dv = _heads(cfg)
    return np.concatenate([np.arange(2 * nk * dk), 2 * nk * dk + grouped(cfg, dv)])


def _qkvz_per_key_head(cfg: dict[str, Any]) -> np.ndarray:
    """Qwen3-Next's in_proj_qkvz from attn_qkv (q | k | v) and attn_gate (z), stacked: per key
    head its q, k, v and z rows."""
    nk, r, dk, dv = _heads(cfg)
    starts = np.cumsum([0, nk * dk, nk * dk, nk * r * dv])  # q, k, v, z in the stack
    sizes = (dk, dk, r * dv, r * dv)
    return np.concatenate(
        [s + h * n + np.arange(n) for h in range(nk) for s, n in zip(starts, sizes, strict=True)]
    )


def _a_log(a: torch.Tensor) -> torch.Tensor:
    return (-a).log()  # the converter wrote -exp(A_log)


def _row(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(1, -1)  # (1, hidden) whether stored so or as a vector


QWEN3_NEXT_FIXES = {
    "blk.{}.ssm_norm": Fix(),  # plain w: not the other norms' 1 + w
    "blk.{}.ffn_gate_inp_shexp": Fix(values=_row),
    "blk.{}.ssm_a": Fix(values=_a_log),
    "blk.{}.ssm_conv1d": Fix(values=lambda w: w.unsqueeze(1)),  # (channels, 1, kernel)
    "blk.{}.attn_qkv": Fix(rows=_qkvz_per_key_head, fused=("blk.{}.attn_gate",)),
}
QWEN3_5_FIXES = {
    "blk.{}.ssm_norm": Fix(),
    "blk.{}.ffn_gate_inp_shexp": Fix(values=_row),
    "blk.{}.ssm_a": Fix(rows=lambda c: grouped(c, 1), values=_a_log),
    "blk.{}.ssm_dt.bias": Fix(rows=lambda c: grouped(c, 1)),
    "blk.{}.ssm_conv1d": Fix(rows=_qkv_grouped, values=lambda w: w.unsqueeze(1)),
    "blk.{}.attn_qkv": Fix(rows=_qkv_grouped),
    "blk.{}.attn_gate": Fix(rows=lambda c: grouped(c, c["linear_value_head_dim"])),
    "blk.{}.ssm_beta": Fix(rows=lambda c: grouped(c, 1)),
    "blk.{}.ssm_alpha": Fix(rows=lambda c: grouped(c, 1)),
    "blk.{}.ssm_out": Fix(cols=lambda c: grouped(c, c["linear_value_head_dim"])),
}


# --- Granite 4.0-H ---------------------------------------------------------------------------
# (conversion/granite.py `GraniteHybridModel`, conversion/mamba.py `Mamba2Model`): A_log stored
# as A = -exp(A_log) and D, both as (heads, 1); the conv1d weight squeezed to (channels,
# kernel); the gated norm's weight as (groups, channels per group)
GRANITE_HYBRID_FIXES = {
    "blk.{}.ssm_a": Fix(values=lambda a: _a_log(a).reshape(-1)),
    "blk.{}.ssm_d": Fix(values=lambda d: d.reshape(-1)),
    "blk.{}.ssm_norm": Fix(values=lambda w: w.reshape(-1)),
    "blk.{}.ssm_conv1d.weight": Fix(values=lambda w: w.unsqueeze(1)),  # (channels, 1, kernel)
}


# --- Nemotron-H (nemotron_h, nemotron_h_moe) ---------------------------------------------------
# conversion/nemotron.py `NemotronHModel` (Mamba2 as conversion/mamba.py writes it): no layer
# pattern (read from the tensors), A_log as A = -exp(A_log) of shape (1, heads), D as (1,
# heads), the conv weight squeezed, the grouped norm's weight as (n_groups, intermediate /
# n_groups); context_length 2 ** 20 (no rope); chunk_size and time_step_min not at all (the
# config's defaults, 128 and 0.001, are every release's).
_MIXER = "model.layers.{}.mixer"
NEMOTRON_H_TENSORS = {  # file template -> the hub's names (model.* for backbone.*)
    "blk.{}.attn_norm": "model.layers.{}.norm",  # the layer's one norm, whatever its mixer
    "blk.{}.attn_q": f"{_MIXER}.q_proj",
    "blk.{}.attn_k": f"{_MIXER}.k_proj",
    "blk.{}.attn_v": f"{_MIXER}.v_proj",
    "blk.{}.attn_output": f"{_MIXER}.o_proj",
    "blk.{}.ffn_up": f"{_MIXER}.up_proj",
    "blk.{}.ffn_down": f"{_MIXER}.down_proj",
    "blk.{}.ffn_gate_inp": f"{_MIXER}.gate",
    "blk.{}.exp_probs_b.bias": f"{_MIXER}.gate.e_score_correction_bias",  # whole names
    "blk.{}.ffn_up_exps": f"{_MIXER}.experts.{{e}}.up_proj",
    "blk.{}.ffn_down_exps": f"{_MIXER}.experts.{{e}}.down_proj",
    "blk.{}.ffn_up_shexp": f"{_MIXER}.shared_experts.up_proj",
    "blk.{}.ffn_down_shexp": f"{_MIXER}.shared_experts.down_proj",
    "blk.{}.ssm_in": f"{_MIXER}.in_proj",
    "blk.{}.ssm_conv1d": f"{_MIXER}.conv1d",
    "blk.{}.ssm_a": f"{_MIXER}.A_log",
    "blk.{}.ssm_d": f"{_MIXER}.D",
    "blk.{}.ssm_dt.bias": f"{_MIXER}.dt_bias",
    "blk.{}.ssm_norm": f"{_MIXER}.norm",
    "blk.{}.ssm_out": f"{_MIXER}.out_proj",
}
NEMOTRON_H_KEYS = {  # {arch}.key -> config.json key
    "attention.layer_norm_epsilon": "layer_norm_epsilon",
    "ssm.conv_kernel": "conv_kernel",
    "ssm.state_size": "ssm_state_size",
    "ssm.group_count": "n_groups",
    "ssm.time_step_rank": "mamba_num_heads",
    "expert_count": "n_routed_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "moe_shared_expert_intermediate_size",
    "expert_weights_scale": "routed_scaling_factor",
}


# Mamba2's tensors: the converter writes them as Granite 4.0-H's (conversion/mamba.py)
NEMOTRON_H_FIXES = GRANITE_HYBRID_FIXES


def nemotron_h_config(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """The layer pattern from each block's tensors (the per-layer arrays cannot say it: the
    converter writes every file whose config has num_experts_per_tok, which transformers 5
    fills in, as nemotron_h_moe, and there an MLP layer's feed_forward_length is 0), the MLP
    width from an MLP layer's up_proj (else the experts'), the attention's kv heads, Mamba2's
    head dim and the renormalisation flag."""
    from plugins.formats.gguf_reader import GGUFFile

    tensors = GGUFFile(path).tensors
    kinds = {"ssm_in.weight": "M", "attn_q.weight": "*", "ffn_up.weight": "-",
             "ffn_up_exps.weight": "E"}  # fmt: skip
    pattern = [next((c for t, c in kinds.items() if f"blk.{i}.{t}" in tensors), "?")
               for i in range(cfg.get("num_hidden_layers", 0))]  # fmt: skip
    cfg["hybrid_override_pattern"] = "".join(pattern)  # "?": refused, naming the field
    kv = meta("attention.head_count_kv")
    cfg["num_key_value_heads"] = max(kv) if isinstance(kv, list) else kv
    up = next((f"blk.{i}.ffn_up.weight" for i, c in enumerate(pattern) if c == "-"), None)
    cfg["intermediate_size"] = tensors[up].shape[0] if up else cfg.get("moe_intermediate_size")
    if meta("ssm.inner_size") and meta("ssm.time_step_rank"):
        cfg["mamba_head_dim"] = meta("ssm.inner_size") // meta("ssm.time_step_rank")
    cfg["norm_topk_prob"] = bool(meta("expert_weights_norm", False))
    return {k: v for k, v in cfg.items() if v is not None}


# --- Falcon-H1 (falcon-h1) ---------------------------------------------------------------------
# conversion/falcon_h1.py: Mamba2's tensors as Granite 4.0-H's (GRANITE_HYBRID_FIXES); every
# muP multiplier folded into the weights it follows (the embedding and the head too), so the
# file's model has none; pre_ff_layernorm written without a leaf (`blk.N.ffn_norm`); whether
# Mamba2 has its gated norm (mamba_rms_norm) stored only as the ssm_norm tensors, and
# llama.cpp's graph gates before that norm (mamba_norm_before_gate false, as TII's configs).
_FH = "model.layers.{}"
FALCON_H1_TENSORS = {  # beside TENSOR_NAMES and Granite 4.0-H's ssm_* names
    "output_norm": "model.final_layernorm",
    "blk.{}.ffn_gate": f"{_FH}.feed_forward.gate_proj",
    "blk.{}.ffn_up": f"{_FH}.feed_forward.up_proj",
    "blk.{}.ffn_down": f"{_FH}.feed_forward.down_proj",
    "blk.{}.ffn_norm": f"{_FH}.pre_ff_layernorm.weight",  # a whole name: no leaf in the file
}
FALCON_H1_KEYS = {"ssm.inner_size": "mamba_d_ssm"}  # beside Granite 4.0-H's ssm.* keys


def falcon_h1_config(meta: Callable[..., Any], cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """Mamba2's head width from ssm.inner_size / ssm.time_step_rank, and its gated norm from
    whether the file has one (gate first: llama.cpp's graph)."""
    from plugins.formats.gguf_reader import GGUFFile

    if meta("ssm.inner_size") and meta("ssm.time_step_rank"):
        cfg["mamba_d_head"] = meta("ssm.inner_size") // meta("ssm.time_step_rank")
    cfg["mamba_rms_norm"] = "blk.0.ssm_norm.weight" in GGUFFile(path).tensors
    cfg["mamba_norm_before_gate"] = False
    return cfg
