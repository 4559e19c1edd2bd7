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
Each attention and each MLP ends in one all-reduce (`row_parallel`); a row-parallel bias is
loaded on rank 0 only (zeros elsewhere), so the sum adds it once. Norms, routers and the
rest are replicated.

The model is built with a *local* `RuntimeConfig` (heads and intermediate sizes / N), and the
checkpoint is seen through `ShardedCheckpoint`, which gives each tensor its local shape and
reads only this rank's slices (safetensors' `get_slice`), so the strict loader runs unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core import distributed
from core.checkpoint import Checkpoint
from core.config import GQASpec, MLASpec, RuntimeConfig
from core.errors import ConfigError, RequestError
from core.layers.embedding import Embedding, LMHead
from core.loader import map_name, strip_prefix
from core.plugins import WeightMap


def _problems(cfg: RuntimeConfig, n: int) -> list[tuple[str, int, str]]:
    """(hub field, value, what N must satisfy) for each size `n` ranks cannot split."""
    out = []
    for i, a in enumerate(cfg.attention_layers):
        if isinstance(a, GQASpec):
            if a.num_heads % n:
                out.append(("num_attention_heads", a.num_heads, "divisible by tp"))
            if a.num_kv_heads % n and n % a.num_kv_heads:
                out.append(("num_key_value_heads", a.num_kv_heads, "a multiple or divisor of tp"))
        elif isinstance(a, MLASpec):
            if a.num_heads % n:
                out.append(("num_attention_heads", a.num_heads, "divisible by tp"))
        else:
            out.append((f"layer {i}'s {type(a).__name__}", 0, "a kind tensor parallelism splits"))
    sizes = [("intermediate_size", cfg.mlp.intermediate_size)]
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
    return dataclasses.replace(
        cfg, attention=_local_attention(cfg.attention, n), attention_layers=layers, mlp=mlp, moe=moe
    )


# --- which part of each checkpoint tensor a rank holds ---------------------------------------
@dataclass(frozen=True)
class Cut:
    """A rank's part of one tensor: along `dim`, its `ranges` (start, stop) concatenated, then
    zero-padded to `pad` (vocab rows); `zero`: all zeros (a row-parallel bias off rank 0)."""

    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    pad: int = 0
    zero: bool = False

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        if self.zero:
            return full
        size = max(self.pad, sum(b - a for a, b in self.ranges))
        return (*full[: self.dim], size, *full[self.dim + 1 :])


class Sharding:
    """The split of one model over `world` ranks, as seen from `rank`."""

    def __init__(self, cfg: RuntimeConfig, rank: int, world: int):
        self.cfg, self.rank, self.world = cfg, rank, world

    def _even(self, size: int, offset: int = 0) -> tuple[int, int]:
        step = size // self.world
        return offset + self.rank * step, offset + (self.rank + 1) * step

    def _halves(self, size: int) -> tuple[tuple[int, int], ...]:
        """[gate | up] stored as one tensor: this rank's rows of each half."""
        return self._even(size // 2), self._even(size // 2, size // 2)

    def _kv(self, a: GQASpec, offset: int = 0) -> tuple[int, int]:
        if a.num_kv_heads >= self.world:
            return self._even(a.num_kv_heads * a.head_dim, offset)
        h = self.rank * a.num_kv_heads // self.world  # fewer KV heads than ranks: replicated
        return offset + h * a.head_dim, offset + (h + 1) * a.head_dim

    def vocab_rows(self) -> tuple[int, int, int]:
        """(first, stop, padded rows per rank) of the vocab-parallel embedding and head."""
        per = math.ceil(self.cfg.vocab_size / self.world)
        lo = min(self.rank * per, self.cfg.vocab_size)
        return lo, min(lo + per, self.cfg.vocab_size), per

    def cut(self, param: str, shard: str | None, full: tuple[int, ...]) -> Cut | None:
        """How this rank cuts the checkpoint tensor of shape `full` that fills `param` (or its
        `shard`); None: replicated whole."""
        if param in ("model.embed_tokens.weight", "lm_head.weight"):
            lo, hi, per = self.vocab_rows()
            return Cut(0, ((lo, hi),), pad=per)
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(\w+)", param)
        if m is None:
            return None
        layer, module, leaf = int(m[1]), m[2], m[3]
        if module.endswith(("o_proj", "down_proj")) and leaf == "bias":
            return None if self.rank == 0 else Cut(zero=True)  # added once, by the all-reduce
        if module == "self_attn.qkv_proj":
            a = self.cfg.layer_attention(layer)
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            parts = {"q": self._even(q), "k": self._kv(a), "v": self._kv(a)}
            if shard is not None:
                return Cut(0, (parts[shard],))
            return Cut(0, (self._even(q), self._kv(a, q), self._kv(a, q + kv)))  # stored fused
        if module == "self_attn" and leaf == "sinks":  # one per query head
            return Cut(0, (self._even(full[0]),))
        if module in ("self_attn.q_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj"):
            return Cut(0, (self._even(full[0]),))  # MLA: rows are head-major
        if module in ("self_attn.o_proj", "mlp.down_proj", "mlp.shared_experts.down_proj"):
            return Cut(1, (self._even(full[1]),))
        if module in ("mlp.gate_up_proj", "mlp.shared_experts.gate_up_proj"):
            return Cut(0, (self._even(full[0]),) if shard else self._halves(full[0]))
        if module.startswith("mlp.experts."):
            return self._experts(module.removeprefix("mlp.experts."), leaf, shard, full)
        return None

    def _experts(self, kind: str, leaf: str, shard: str | None, full) -> Cut:
        """Stacked routed experts: each expert's intermediate rows (gate_up) or columns (down).
        A per-expert checkpoint tensor (shard "e.gate", "e") is 2-D; a stacked one (shard
        None) is (E, rows, cols); shard "T" is stacked and transposed (gpt-oss)."""
        if kind == "down_proj":  # (H, I), (E, H, I) or transposed (E, I, H)
            dim = {None: 2, "T": 1}.get(shard, 1)
            return Cut(dim, (self._even(full[dim]),))
        if leaf == "bias":  # (E, 2I)
            dim = 1
        else:  # (I, H) per expert part, (E, 2I, H) stacked or (E, H, 2I) transposed
            dim = {None: 1, "T": 2}.get(shard, 0)
        if dim == 0:
            return Cut(0, (self._even(full[0]),))
        # [gate | up] halves; gpt-oss's interleaved (gate, up) row pairs: one even cut
        interleaved = self.cfg.moe is not None and self.cfg.moe.glu is not None
        return Cut(dim, (self._even(full[dim]),) if interleaved else self._halves(full[dim]))


class ShardedCheckpoint:
    """A checkpoint as one rank sees it: each mapped tensor has its local shape, and reading it
    reads only the rank's slices (`read_slice` where the format has it: safetensors; else the
    whole tensor is read, dequantized if need be, then sliced: GGUF)."""

    def __init__(self, ckpt: Checkpoint, weight_map: WeightMap, sharding: Sharding):
        self.inner, self.sharding, self.path = ckpt, sharding, ckpt.path
        self._cuts: dict[str, Cut | None] = {}
        for name in ckpt.tensor_names():
            local = strip_prefix(name, weight_map)
            mapped = None if local is None else map_name(local, weight_map)
            if mapped is not None:
                self._cuts[name] = sharding.cut(*mapped, tuple(ckpt.shape(name)))

    def config(self):
        return self.inner.config()

    def tokenizer(self):
        return self.inner.tokenizer()

    def generation_config(self):
        return self.inner.generation_config()

    def close(self) -> None:
        self.inner.close()

    def tensor_names(self) -> list[str]:
        return self.inner.tensor_names()

    def shape(self, name: str) -> tuple[int, ...]:
        full, cut = tuple(self.inner.shape(name)), self._cuts.get(name)
        return full if cut is None else cut.shape(full)

    def read(self, name: str) -> torch.Tensor:
        cut = self._cuts.get(name)
        if cut is None:
            return self.inner.read(name)
        if cut.zero:
            return torch.zeros(self.inner.shape(name))
        fast = getattr(self.inner, "read_slice", None)
        t = fast(name, cut.dim, cut.ranges) if fast is not None else None
        if t is None:
            whole = self.inner.read(name)
            t = torch.cat([whole.narrow(cut.dim, a, b - a) for a, b in cut.ranges], cut.dim)
        missing = cut.pad - t.shape[cut.dim]
        if missing > 0:  # the last rank's vocab rows past the vocabulary
            pad = [0, 0] * (t.ndim - 1 - cut.dim) + [0, missing]
            t = F.pad(t, pad)
        return t


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


_ROW_PARALLEL: dict[type, type] = {}


def row_parallel(module: nn.Module) -> None:
    """Make `module` (an attention or MLP whose last linear is row-parallel) sum its output
    over the ranks: its class becomes a subclass whose forward ends in one all-reduce. A
    subclass, not a hook, so that no fast path that matches the plain class (the fused CPU
    decode step) runs it without the sum."""
    cls = type(module)
    sub = _ROW_PARALLEL.get(cls)
    if sub is None:

        def forward(self, *args, **kwargs):
            return distributed.all_reduce(cls.forward(self, *args, **kwargs))

        doc = f"{cls.__name__} over this rank's heads / intermediate rows, summed over ranks."
        sub = type(f"RowParallel{cls.__name__}", (cls,), {"forward": forward, "__doc__": doc})
        _ROW_PARALLEL[cls] = sub
    module.__class__ = sub


def parallelize(net: nn.Module, sharding: Sharding) -> None:
    """Swap in the vocab-parallel embedding and head, and make every attention and MLP sum
    its partial output across ranks (one all-reduce each). `net` is on the meta device."""
    cfg = sharding.cfg
    lo, hi, per = sharding.vocab_rows()
    with torch.device("meta"):
        embed = VocabParallelEmbedding(per, cfg.hidden_size, cfg.embedding, lo, hi)
        tied = embed if cfg.tie_word_embeddings else None
        net.model.embed_tokens = embed
        net.lm_head = VocabParallelLMHead(cfg.hidden_size, per, cfg.vocab_size, tied)
    for block in net.model.layers:
        row_parallel(block.self_attn)
        row_parallel(block.mlp)


def resident_bytes(net: nn.Module) -> int:
    """Bytes of this rank's parameters (what tensor parallelism divides)."""
    return sum(p.numel() * p.element_size() for p in net.parameters())
