"""Which part of each checkpoint tensor a tensor-parallel rank holds (core/parallel/tp.py), and the
checkpoint as one rank sees it: local shapes, and only the rank's slices read."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.checkpoint import Checkpoint
from core.config import GQASpec, RuntimeConfig
from core.loader import map_name, strip_prefix
from core.plugins import WeightMap


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
        if layer >= self.cfg.num_layers:  # a layer the model skips (GLM-4.5's MTP module)
            return None
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
