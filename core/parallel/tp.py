"""Tensor parallelism: one model split across the ranks of a torch.distributed group.

Megatron's split, as gpt-fast's tp.py and vLLM do it, declared per parameter name:
- attention: q|k|v column-parallel by heads (each rank runs num_heads / N query heads; KV heads
  split too, or replicated where there are fewer than N: rank r keeps KV head r * H_kv // N),
  o_proj row-parallel; MLA: q_b / q_proj and kv_b by heads, o_proj row-parallel, while the
  latent projections (q_a, kv_a) are replicated: every rank caches the whole latent;
- dense MLP: gate|up column-parallel, down row-parallel;
- MoE: every routed and shared expert split the same way (each expert's intermediate size / N);
  the router is replicated, so every rank routes every token alike;
- embedding and LM head vocab-parallel (rows padded to a multiple of N).
Each attention's and each MLP's output is summed by one all-reduce (`DecoderBlock.reduce`);
a row-parallel bias is loaded on rank 0 only (zeros elsewhere), so the sum adds it once.
Norms, routers and the rest are replicated.

The model is built with a *local* `RuntimeConfig` (heads and intermediate sizes / N), and the
checkpoint is seen through `ShardedCheckpoint` (core/parallel/slices.py), which gives each tensor
its local shape and reads only this rank's slices (safetensors' `get_slice`), so the strict
loader runs unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from core.config import DenseMLPSpec, GQASpec, MLASpec, RuntimeConfig
from core.config_kinds import SparseMLASpec
from core.errors import ConfigError, RequestError
from core.layers.embedding import Embedding, LMHead
from core.parallel import distributed
from core.parallel.slices import ShardedCheckpoint, Sharding

SPLIT = "a kind tensor parallelism splits"


def _problems(cfg: RuntimeConfig, n: int) -> list[tuple[str, int, str]]:
    """(hub field, value, what N must satisfy) for each size `n` ranks cannot split."""
    out = []
    for i, a in enumerate(cfg.attention_layers):
        if isinstance(a, GQASpec):
            if a.num_heads % n:
                out.append(("num_attention_heads", a.num_heads, "divisible by tp"))
            if a.num_kv_heads % n and n % a.num_kv_heads:
                out.append(("num_key_value_heads", a.num_kv_heads, "a multiple or divisor of tp"))
            if a.qk_norm_all_heads and n > 1:  # OLMo 2 / 3: the norm spans every rank's heads
                out.append((f"layer {i}'s q/k norm over all heads", 0, "a kind tp splits"))
            if a.kv_source is not None or a.k_eq_v:  # Gemma 4: no split rule yet
                out.append((f"layer {i}'s shared K/V or K = V attention", 0, SPLIT))
        elif isinstance(a, SparseMLASpec):  # the indexer and its selection are not split
            out.append((f"layer {i}'s DeepSeek sparse attention", 0, SPLIT))
        elif isinstance(a, MLASpec):
            if a.num_heads % n:
                out.append(("num_attention_heads", a.num_heads, "divisible by tp"))
        else:
            out.append((f"layer {i}'s {type(a).__name__}", 0, SPLIT))
    if cfg.per_layer_input is not None:
        out.append(("the per-layer inputs (hidden_size_per_layer_input)", 0, SPLIT))
    if any(type(m) is not DenseMLPSpec for m in cfg.mlp_layers):
        out.append(("an MLP kind of mlp_layers (Gemma 4's dense + routed experts)", 0, SPLIT))
    sizes = [("intermediate_size", cfg.mlp.intermediate_size)]
    # per-layer MLP widths (Gemma 4's double-wide layers): each cut as the model's
    sizes += [(f"layer {i}'s MLP width", m.intermediate_size)
              for i, m in enumerate(cfg.mlp_layers) if type(m) is DenseMLPSpec]  # fmt: skip
    if cfg.moe is not None:
        sizes.append(("moe_intermediate_size", cfg.moe.intermediate_size))
    out += [(f, v, "divisible by tp") for f, v in sizes if v % n]
    return list(dict.fromkeys(out))


def check(cfg: RuntimeConfig, n: int, source: str) -> None:
    """Raise a `ConfigError` naming the field that `n` ranks cannot split, and the valid N."""
    if n < 1:
        raise ConfigError(f"tp={n}: the number of ranks must be at least 1")
    problems = _problems(cfg, n)
    if not problems:
        return
    valid = [k for k in range(1, 65) if not _problems(cfg, k)]
    field, value, need = problems[0]
    if value == 0:  # a layer kind without a split rule (a plugin's own, or linear attention)
        raise ConfigError(f"{source}: tp={n}: {field} is not {need}; run it with tp=1")
    raise ConfigError(
        f"{source}: tp={n} cannot split {field} = {value} (it must be {need}); "
        f"tensor-parallel sizes this model allows: {', '.join(map(str, valid))}"
    )


def tensor_parallel(
    cfg: RuntimeConfig, n: int, device: torch.device, source: str, compile: bool, quantize
) -> tuple[Sharding, torch.device]:
    """Check that `n` ranks can split this model, then join their group: (this rank's
    `Sharding`, its device)."""
    check(cfg, n, source)
    if compile or quantize is not None:
        what = "compile=True" if compile else f"quantize={quantize!r}"
        raise RequestError(f"{what} does not combine with tp={n} yet; drop one of the two")
    device = distributed.start(n, device)
    return Sharding(cfg, distributed.rank(), n), device


def _local_attention(a, n: int):
    if isinstance(a, GQASpec):
        return dataclasses.replace(
            a, num_heads=a.num_heads // n, num_kv_heads=max(1, a.num_kv_heads // n)
        )
    return dataclasses.replace(a, num_heads=a.num_heads // n)  # MLA: the latent stays whole


def local_config(cfg: RuntimeConfig, n: int) -> RuntimeConfig:
    """The config one rank builds: heads and intermediate sizes / n (vocab stays global: the
    embedding and head are swapped for vocab-parallel ones by `parallelize`)."""
    mlp = dataclasses.replace(cfg.mlp, intermediate_size=cfg.mlp.intermediate_size // n)
    moe = cfg.moe
    if moe is not None:  # shared experts: num_shared * intermediate_size, so / n too
        moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // n)
    layers = tuple(_local_attention(a, n) for a in cfg.attention_layers)
    mlps = tuple(  # per-layer MLPs (only dense ones pass `check`): cut as `mlp`
        dataclasses.replace(m, intermediate_size=m.intermediate_size // n) for m in cfg.mlp_layers
    )
    return dataclasses.replace(
        cfg,
        attention=_local_attention(cfg.attention, n),
        attention_layers=layers,
        mlp=mlp,
        moe=moe,
        mlp_layers=mlps,
    )


# --- the modules that communicate ------------------------------------------------------------
class VocabParallelEmbedding(Embedding):
    """Rows [lo, hi) of the vocabulary; other ids look up zeros; the all-reduce sums them."""

    def __init__(self, rows: int, hidden: int, spec, lo: int, hi: int):
        super().__init__(rows, hidden, spec)
        self.lo, self.hi = lo, hi

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.lo) | (ids >= self.hi)
        local = (ids - self.lo).masked_fill(outside, 0)
        x = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        x = distributed.all_reduce(x)
        if self.scale == 1.0:
            return x
        return x * torch.tensor(self.scale, dtype=x.dtype, device=x.device)


class VocabParallelLMHead(LMHead):
    """Each rank's logits for its vocab rows, gathered: (..., vocab) on every rank."""

    def __init__(self, hidden: int, rows: int, vocab: int, tied_to: nn.Module | None):
        super().__init__(hidden, rows, tied_to)
        self.vocab = vocab

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return distributed.all_gather(super().forward(h))[..., : self.vocab]


def parallelize(net: nn.Module, sharding: Sharding) -> None:
    """Swap in the vocab-parallel embedding and head, and make every block sum its attention's
    and MLP's partial outputs across ranks (`DecoderBlock.reduce`: one all-reduce each). `net`
    is on the meta device."""
    cfg = sharding.cfg
    lo, hi, per = sharding.vocab_rows()
    with torch.device("meta"):
        embed = VocabParallelEmbedding(per, cfg.hidden_size, cfg.embedding, lo, hi)
        tied = embed if cfg.tie_word_embeddings else None
        net.model.embed_tokens = embed
        net.lm_head = VocabParallelLMHead(cfg.hidden_size, per, cfg.vocab_size, tied)
    for block in net.model.layers:
        block.reduce = distributed.all_reduce


def resident_bytes(net: nn.Module) -> int:
    """Bytes of this rank's parameters (what tensor parallelism divides)."""
    return sum(p.numel() * p.element_size() for p in net.parameters())


__all__ = [  # ShardedCheckpoint and Sharding live in core/parallel/slices.py
    "ShardedCheckpoint",
    "Sharding",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "check",
    "local_config",
    "parallelize",
    "resident_bytes",
    "tensor_parallel",
]
