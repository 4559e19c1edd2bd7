"""A checkpoint's own multi-token-prediction (MTP) layer, DeepSeek V3's kind (R1's, GLM-4.5's),
which speculative decoding runs to draft tokens (core/spec_mtp.py; load_model(speculative="mtp")).

DeepSeek V3 stores one MTP module after its decoder layers, as `model.layers.{N}.*` with N =
num_hidden_layers (README_WEIGHTS.md in deepseek-ai/DeepSeek-V3): `enorm` and `hnorm`
(RMSNorm), `eh_proj` (linear 2H -> H, no bias), a whole decoder layer (`self_attn`, `mlp`,
`input_layernorm`, `post_attention_layernorm`: MLA and MoE for V3, `RuntimeConfig.mtp`),
`shared_head.norm`, and copies of the embedding (`embed_tokens`) and LM head
(`shared_head.head`), which the module shares with the main model (the README says so; SGLang
reads the main model's too): those two copies are not loaded. For position i, with h_i the main
model's last-layer output there (before its final norm) and t_{i+1} the next token:

    x = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])      (the embedding first)
    y = layer(x) at position i, in the MTP's own one-layer KV cache
    logits = lm_head(shared_head.norm(y))                  (predicting t_{i+2})

DeepSeek's published inference code skips the module (inference/convert.py drops
`model.layers.61`), so this follows the V3 technical report (section 2.2) with the order of the
concatenation that runs the released weights: vLLM's deepseek_mtp.py, SGLang's
deepseek_nextn.py and Megatron-LM's MTP all put the normed embedding first (`eh_proj`), where
the report's equation 21 writes h first. No embedding is zeroed at position 0 (vLLM does; the
report, SGLang and Megatron-LM do not). y also stands in for h_{i+1} when the one layer drafts a
second token, as vLLM reuses its layers past num_nextn_predict_layers. Only the first MTP layer
is run.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from core.config import MoESpec, RuntimeConfig
from core.errors import ConfigError
from core.kv_cache import StaticKVCache
from core.layers import Linear, RotaryEmbedding
from core.modeling import DecoderBlock, build

# tensors of the MTP module that are copies of the main model's (shared, not loaded)
COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def layer_config(cfg: RuntimeConfig) -> RuntimeConfig:
    """A one-layer config whose layer 0 is `cfg`'s MTP layer: what builds its block and cache."""
    a, m = cfg.mtp.attention, cfg.mtp.mlp
    moe = replace(m, layers=(0,)) if isinstance(m, MoESpec) else None
    return replace(
        cfg, num_layers=1, attention=a, attention_layers=(a,), moe=moe,
        mlp=cfg.mlp if moe is not None else m, mlp_layers=(), mtp_layers=0, mtp=None,
    )  # fmt: skip


class MTPLayer(DecoderBlock):
    """The decoder layer (this block's own parameters) behind enorm / hnorm / eh_proj, and
    the norm before the shared LM head (`shared_head.norm`)."""

    def __init__(self, cfg: RuntimeConfig):
        super().__init__(cfg, 0)
        h = cfg.hidden_size
        self.enorm = build(cfg.norm, h, cfg.norm)
        self.hnorm = build(cfg.norm, h, cfg.norm)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = build(cfg.norm, h, cfg.norm)

    def forward(self, embeds, hidden, cos, sin, cache, start_pos: int, end: int):
        """embeds (B, T, H) of tokens t_{i+1}, hidden (B, T, H) h_i -> the layer's output y."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return super().forward(x, cos, sin, cache, start_pos, end)


class MTPNetwork(nn.Module):
    """`cfg`'s first MTP layer under its checkpoint names (`model.layers.{N}.*`, so that the
    architecture's weight map loads it as it is), with a cache of its own (`setup_caches`:
    one layer, rows as the main cache's). Built on the meta device and loaded like the main
    network (`ignored_checkpoint_names`: every tensor but its own)."""

    def __init__(self, cfg: RuntimeConfig):
        super().__init__()
        self.config = layer_config(cfg)
        self.index = cfg.num_layers
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(self.index): MTPLayer(self.config)})
        self.kv_cache: StaticKVCache | None = None
        self.rotary: RotaryEmbedding | None = None

    @property
    def layer(self) -> MTPLayer:
        return self.model.layers[str(self.index)]

    def ignored_checkpoint_names(self) -> _NotOwn:
        return _NotOwn(f"model.layers.{self.index}.")

    def setup_caches(self, max_batch_size: int, max_seq_len: int, dtype, device) -> None:
        """Its one-layer cache of max_batch_size rows of max_seq_len positions, and rope table."""
        cfg = self.config
        self.kv_cache = StaticKVCache(cfg, max_batch_size, max_seq_len, dtype, device, 0)
        if self.kv_cache.kept < max_seq_len or self.kv_cache.recurrent:  # (not DeepSeek's kind)
            raise ConfigError("an MTP layer with a sliding window or a recurrent state is not run")
        rope = cfg.layer_rope(0)
        self.rotary = None if rope is None else RotaryEmbedding(rope, max_seq_len, device)

    def forward(self, embeds, hidden, start: int, row: int) -> torch.Tensor:
        """embeds (1, T, H) of tokens t_{i+1} and hidden (1, T, H) h_i at positions start..
        of cache `row` -> the layer's outputs y (1, T, H); fills those positions of its cache."""
        t = embeds.shape[1]
        cos, sin = (None, None) if self.rotary is None else self.rotary(start, t, start + t)
        cache = self.kv_cache.row(row).layer(0)
        return self.layer(embeds, hidden, cos, sin, cache, start, start + t)

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """Row dst of its cache takes row src's first n positions (as the main cache's)."""
        self.kv_cache.copy(src, dst, n)


def mtp_network(cfg: RuntimeConfig, ckpt, source: str, tp: int = 1) -> MTPNetwork:
    """`cfg`'s MTP layer on the meta device, to load from `ckpt` (`source` named in errors);
    refused (ConfigError) for a model without an MTP layer the core runs, a checkpoint
    without its tensors, or tensor parallelism."""
    other = (
        "pass speculative='ngram' (prompt lookup) or a draft model instead "
        "(`--spec ngram` or `--draft MODEL` on the command line)"
    )
    if cfg.mtp is None:
        why = (
            "has no multi-token-prediction layer Zoo runs"
            if not cfg.mtp_layers
            else f"has {cfg.mtp_layers} multi-token-prediction layer(s) of a kind Zoo does not run"
        )
        raise ConfigError(
            f"{source}: this {cfg.model_type} model {why} (it runs DeepSeek V3's and GLM-4.5's, "
            f"`num_nextn_predict_layers`); {other}"
        )
    if tp != 1:
        raise ConfigError(f"speculative='mtp' runs on one rank only, not tp={tp}; {other}")
    prefix = f"model.layers.{cfg.num_layers}."
    if not any(n.startswith(prefix) for n in ckpt.tensor_names()):
        raise ConfigError(
            f"{source}: config.json declares {cfg.mtp_layers} MTP layer(s), but the checkpoint "
            f"holds no {prefix}* tensors (a GGUF file's or a stripped copy); {other}"
        )
    with torch.device("meta"):
        return MTPNetwork(cfg)


class _NotOwn:
    """The checkpoint names an MTPNetwork does not load: all but its layer's, and the copies
    of the main model's embedding and LM head within it."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def __contains__(self, name: object) -> bool:
        name = str(name)
        return not name.startswith(self.prefix) or name[len(self.prefix) :] in COPIES
