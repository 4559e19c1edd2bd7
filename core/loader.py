"""The strict weight loader: checkpoint tensors -> a model built on the meta device.

Every parameter (and every shard of a fused one) must be filled exactly once. The whole plan is
checked from metadata first, so missing, unexpected and wrong-shape tensors are reported together
before a single byte is read; then each tensor is copied straight into its target dtype/device.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Container, Iterator

import torch
from torch import nn

from core import quantize
from core.checkpoint import Checkpoint
from core.errors import CheckpointError
from core.plugins import WeightMap, WeightScales

log = logging.getLogger("zoo")


def strip_prefix(name: str, weight_map: WeightMap) -> str | None:
    """Apply the weight map's prefix rules: a key `"a.b.*"` renames every tensor under `a.b.`
    to its value's prefix (`"model.*"`), or skips them all when its value is None (a
    multimodal checkpoint's vision tower). Names under no rule come back unchanged."""
    for key, target in weight_map.items():
        if key.endswith(".*") and name.startswith(key[:-1]):
            return None if target is None else target[:-1] + name[len(key) - 1 :]
    return name


def map_name(name: str, weight_map: WeightMap) -> tuple[str, str | None] | None:
    """Checkpoint tensor name -> (core parameter name, shard or None); None skips the tensor.

    `model.layers.3.mlp.gate_proj.weight` looks up `model.layers.{}.mlp.gate_proj`; the layer
    indices fill the target's `{}`s first, then the shard's (for stacked experts). A key may
    also name a whole tensor, leaf included, for tensors stored without a `.weight` leaf
    (transformers 5's stacked `mlp.experts.gate_up_proj`); its target is then a whole
    parameter name. Whole-tensor keys are looked up first.
    """
    whole = _template(name.split("."))
    if whole in weight_map:
        return _target(weight_map[whole], _indices(name.split(".")), None)
    module, _, leaf = name.rpartition(".")
    parts = module.split(".")
    key = _template(parts)
    if key not in weight_map:
        return name, None  # identity: core parameters carry the hub's names
    return _target(weight_map[key], _indices(parts), leaf)


def _target(target, ints: list[str], leaf: str | None) -> tuple[str, str | None] | None:
    """A weight map entry filled with the name's indices (and leaf), as `map_name` returns it."""
    if target is None:
        return None
    shard = None
    if isinstance(target, tuple):
        target, shard = target
    n = target.count("{}")
    target = target.format(*ints[:n])
    if shard is not None:
        shard = shard.format(*ints[n:])
    if leaf is None:
        return target, shard
    return (f"{target}.{leaf}" if target else leaf), shard


def _is_index(part: str) -> bool:
    return part.isascii() and part.isdigit()


def _indices(parts: list[str]) -> list[str]:
    return [p for p in parts if _is_index(p)]


def _template(parts: list[str]) -> str:
    return ".".join("{}" if _is_index(p) else p for p in parts)


def checkpoint_name(param: str, shard: str | None, weight_map: WeightMap) -> str:
    """The inverse of `map_name`: the checkpoint tensor that fills `param` (or its `shard`),
    e.g. `model.layers.2.self_attn.qkv_proj.weight`, shard `k` ->
    `model.layers.2.self_attn.k_proj.weight`: the name a user finds in their file."""
    module, _, leaf = param.rpartition(".")
    for key, target in weight_map.items():
        if target is None or key.endswith(".*"):
            continue
        want_shard = None
        if isinstance(target, tuple):
            target, want_shard = target
        if (want_shard is None) != (shard is None):
            continue
        ints = _match(target, module)
        if ints is None:
            continue
        if shard is not None:
            more = _match(want_shard, shard)
            if more is None:
                continue
            ints += more
        return f"{key.format(*ints)}.{leaf}" if key else leaf
    return param if shard is None else f"{param}[{shard}]"


def _match(pattern: str, text: str) -> list[str] | None:
    """The values of `pattern`'s `{}`s in `text`, or None when it does not match."""
    regex = "".join(r"(\d+)" if part == "{}" else re.escape(part)
                    for part in re.split(r"(\{\})", pattern))  # fmt: skip
    m = re.fullmatch(regex, text)
    return None if m is None else list(m.groups())


def _listing(kind: str, items: list[str], limit: int = 8) -> str:
    more = f", ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"{len(items)} {kind} ({', '.join(items[:limit])}{more})"


def plan_load(
    net: nn.Module, ckpt: Checkpoint, weight_map: WeightMap, ignore: Container[str]
) -> list[tuple[str, str, tuple]]:
    """Check the checkpoint against the model from metadata alone.

    Returns (checkpoint name, parameter name, index into the parameter) triples, or raises one
    `CheckpointError` listing every missing, unexpected, duplicate and wrong-shape tensor.
    """
    params = dict(net.named_parameters())
    plan, filled = [], defaultdict(set)
    unexpected, wrong, duplicate = [], [], []
    for name in ckpt.tensor_names():
        local = strip_prefix(name, weight_map)  # None: under a skipped prefix
        mapped = None if local is None or local in ignore else map_name(local, weight_map)
        if mapped is None:
            continue
        target, shard = mapped
        p = params.get(target)
        shards = getattr(p, "shards", None)
        if p is None or (shard is not None and (shards is None or shard not in shards)):
            unexpected.append(name)
            continue
        index = () if shard is None else shards[shard]
        want, got = tuple(_part(p, index).shape), ckpt.shape(name)
        if want != got:
            wrong.append(f"{name}: {list(got)} but the model needs {list(want)}")
            continue
        if shard in filled[target]:
            duplicate.append(name)
        filled[target].add(shard)
        plan.append((name, target, index))
    missing = []
    for pname, p in params.items():
        shards = getattr(p, "shards", None) or {None: ()}
        need = {s for s, index in shards.items() if not callable(index)}
        whole = {None} | {s for s, index in shards.items() if callable(index)}
        have = filled.get(pname, set())
        # a fused parameter may also be stored whole (shard None), e.g. Phi-3's qkv_proj, or
        # whole through a view shard (stacked experts stored transposed)
        if have != need and not (len(have) == 1 and have <= whole):
            missing += [checkpoint_name(pname, s, weight_map) for s in sorted(need - have, key=str)]
    problems = [
        _listing(kind, items)
        for kind, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("with the wrong shape", wrong),
            ("given twice", duplicate),
        )
        if items
    ]
    if problems:
        raise CheckpointError(
            f"{ckpt.path}: the checkpoint does not fit the model: {'; '.join(problems)}. "
            "Check that config.json belongs to these weights."
        )
    return plan


def load_weights(
    net: nn.Module,
    ckpt: Checkpoint,
    weight_map: WeightMap,
    *,
    dtype: torch.dtype,
    device: torch.device,
    ignore: Container[str] = frozenset(),
    progress: bool = False,
    keep_quantized: bool = True,
    plan: list | None = None,
    scales: WeightScales | None = None,
) -> None:
    """Fill `net` (built on the meta device) from `ckpt`, converting on the fly.

    `ignore` holds checkpoint names to skip (any container: a set, or a rule by name).
    Parameters marked `keep_fp32` (e.g. a router's correction bias) stay in float32.
    keep_quantized: a linear or embedding weight that the checkpoint stores in a block format
    (GGUF; fp8 on GPUs of compute capability 8.9+) becomes a `QuantWeight` of the same blocks
    instead of floats (core/quantize.py). plan: `plan_load`'s, where the caller made it already.
    scales: checkpoint tensors multiplied by a constant as they are read (`scale_tensor`).
    """
    plan = plan if plan is not None else plan_load(net, ckpt, weight_map, ignore)
    scales = scales or {}
    state: dict[str, torch.Tensor] = {}
    if keep_quantized:
        kept, plan = quantize.split_plan(net, ckpt, plan, device)
        scaled = [
            n for parts in kept.values() for n, *_ in parts if _template(n.split(".")) in scales
        ]
        if scaled:
            raise CheckpointError(
                f"{ckpt.path}: {scaled[0]} is stored quantized, but the model folds a multiplier "
                "into it as it loads; load with dequantize=True (zoo --dequantize) to convert it "
                "to floats, or from a float checkpoint"
            )
        for target, parts in _progress(list(kept.items()), progress, "keeping quantized"):
            w = quantize.read_kept(ckpt, parts, dtype, device)
            state.update(quantize.install(net, target, w))
    state.update(
        (n, torch.empty(p.shape, dtype=torch.float32 if getattr(p, "keep_fp32", False) else dtype,
                        device=device))
        for n, p in net.named_parameters()
    )  # fmt: skip
    for name, target, index in _progress(plan, progress):
        factor = scales.get(_template(name.split(".")))
        t = ckpt.read(name)
        _part(state[target], index).copy_(t if factor is None else scale_tensor(t, factor, name))
    net.load_state_dict(state, strict=True, assign=True)


def scale_tensor(
    t: torch.Tensor, factor: float | tuple[tuple[int, float], ...], name: str = "a tensor"
) -> torch.Tensor:
    """t (checkpoint tensor `name`) times `factor`, in fp32: a float, or (rows, factor)
    segments along t's first dim (Falcon-H1's in_proj: one factor each for z, x, B, C, dt)."""
    if isinstance(factor, int | float):
        return t.float() * factor
    rows = torch.tensor([n for n, _ in factor])
    if int(rows.sum()) != t.shape[0]:
        raise CheckpointError(
            f"{name}: its multipliers cover {int(rows.sum())} rows, but it has {t.shape[0]}; "
            "check that config.json belongs to these weights"
        )
    f = torch.tensor([x for _, x in factor], dtype=torch.float32).repeat_interleave(rows)
    return t.float() * f.view(-1, *([1] * (t.dim() - 1)))


def _part(p: torch.Tensor, index) -> torch.Tensor:
    """The part of p a shard names: p[index], or index(p) for a view shard (a callable that
    returns a view of the whole parameter, e.g. its transpose)."""
    return index(p) if callable(index) else p[index]


def _progress(plan: list, enabled: bool, desc: str = "loading weights") -> Iterator:
    if not enabled or not plan:
        return iter(plan)
    from tqdm import tqdm

    # disable=None: a bar on a terminal, nothing in logs and pipes
    return iter(tqdm(plan, desc=desc, unit="tensor", leave=False, disable=None))
