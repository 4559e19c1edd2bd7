"""`zoo info`, `zoo list` and `zoo plugins`: what a model is and how it will run, the named
models, the loaded plugins."""

from __future__ import annotations

import argparse

from core.cli.common import load


def info(args: argparse.Namespace) -> None:
    from core.quantize import weight_formats

    m = load(args, max_seq_len=16)
    c = m.config
    formats = weight_formats(m.net)
    params = sum(n for n, _ in formats.values())
    print(f"model        {m.path}")
    print(f"architecture {c.model_type}")
    print(f"parameters   {params:,}")
    print(f"layers       {c.num_layers} x hidden {c.hidden_size}, vocab {c.vocab_size}")
    print(f"attention    {type(c.attention).__name__}: {_attention_detail(c)}")
    print(f"rope         {_ropes(c)}")
    print(f"dtype        {c.dtype} (loaded as {str(m.dtype).removeprefix('torch.')})")
    print(f"layer kinds  {_layer_kinds(c)}")
    kv = m.net.kv_cache.dtype
    size, seq = kv.itemsize, c.max_position_embeddings
    print(
        f"KV bytes     {c.kv_bytes_per_token(size):,} per token (full layers, "
        f"{str(kv).removeprefix('torch.')}), {c.kv_bytes(size, seq):,} per sequence of "
        f"{seq:,} tokens"
    )
    state = c.state_bytes_per_sequence(size)
    if state:  # linear-attention layers: a fixed-size state per sequence, whatever its length
        print(f"state bytes  {state:,} per sequence (recurrent layers' conv windows and states)")
        cache = m.net.kv_cache
        print(
            f"snapshots    {cache.snapshot_bytes:,} bytes per row ({cache.snapshots} of the "
            f"state, every {cache.snapshot_interval} tokens; --snapshots)"
        )
    print(f"decode step  {_decode_path(m)}")
    total = sum(b for _, b in formats.values())
    print(f"weights      {total:,} bytes resident")
    for kind, (n, b) in formats.items():
        print(f"  {kind:<10} {n:>14,} parameters {b:>14,} bytes")
    if m.path.is_dir():
        files = sorted(p.name for p in m.path.iterdir() if p.is_file())
        print(f"files        {', '.join(files)}")


def _decode_path(m) -> str:
    """Which decode step a reply takes: the fused C blocks (CPU), or the modules and why."""
    if m.step.compiled is not None:
        return "compiled (torch.compile)"
    if m.step.fused is None:
        return f"eager modules ({m.device.type})"
    from core.cpu_step import kinds  # (the CLI imports torch's side only where it runs)

    why = m.step.fused.why_not()
    if why is not None:
        return f"eager modules ({why})"
    return f"eager, fused C blocks (core/cpu_step.py): {kinds(m.net)}"


def _layer_kinds(c) -> str:
    """How many layers of each attention kind: 'full x 24, window 4096 x 12, NoPE x 9' (and
    'shared K/V x 20': layers reading an earlier layer's keys and values);
    recurrent layers by their spec's kind or name ('GatedDeltaNetSpec x 36, full x 12', 'short
    conv x 10'); layers without attention (Nemotron-H's MLP and MoE layers) as 'MLP only'."""
    from core.config_kinds import NoSubBlock, SparseMLASpec

    kinds: dict[str, int] = {}
    for i in range(c.num_layers):
        spec = c.layer_attention(i)
        if isinstance(spec, NoSubBlock):
            kinds["MLP only"] = kinds.get("MLP only", 0) + 1
            continue
        if getattr(spec, "recurrent", False):
            name = getattr(spec, "kind", type(spec).__name__)  # Mamba2Spec: 'mamba2'
            kinds[name] = kinds.get(name, 0) + 1
            continue
        window = getattr(spec, "window", None)
        kind = "full" if window is None else f"window {window}"
        if getattr(spec, "chunk", None) is not None:
            kind = f"chunk {spec.chunk}"
        if isinstance(spec, SparseMLASpec):  # DSA: its own indexer's keys, or reused
            shared = " (shared selection)" if spec.shared_selection else ""
            kind = f"sparse top-{spec.index_topk}{shared}"
        # a kind that names itself (DeepSeek V4's, whose spec has an index_topk of its own)
        kind = getattr(spec, "kind", kind)
        kinds[kind] = kinds.get(kind, 0) + 1
        if c.layer_rope(i) is None:
            kinds["NoPE"] = kinds.get("NoPE", 0) + 1
        if getattr(spec, "kv_source", None) is not None:  # Gemma 4: no cache of its own
            kinds["shared K/V"] = kinds.get("shared K/V", 0) + 1
    return ", ".join(f"{k} x {n}" for k, n in kinds.items())


def _ropes(c) -> str:
    """The rope of every layer: 'DefaultRope theta=10000' where all layers share one, else each
    with its count: 'DefaultRope theta=10000 x 28, ProportionalRope theta=1e+06 x 7' (Gemma 4's
    window and full layers; 'none' for NoPE layers; linear-attention layers and those without
    attention have none to count)."""
    from core.config_kinds import NoSubBlock

    counts: dict[str, int] = {}
    for i in range(c.num_layers):
        spec = c.layer_attention(i)
        if getattr(spec, "recurrent", False) or isinstance(spec, NoSubBlock):
            continue  # linear attention, or no attention at all (Nemotron-H's MLP layers)
        rope = c.layer_rope(i)
        name = "none" if rope is None else f"{type(rope).__name__} theta={rope.theta:g}"
        counts[name] = counts.get(name, 0) + 1
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{k} x {n}" for k, n in counts.items())


def _attention_detail(c) -> str:
    """The model's attention spec, each field with its values over the layers of that kind
    where they differ ('head_dim 8/16': Gemma 4's window and full layers); nested specs (a
    layer's rope: the rope line) and unset fields left out."""
    a = c.attention
    # a parallel layer's attention (Falcon-H1's ParallelMixerSpec) counts as its own
    same = [s for s in (getattr(s, "attention", s) for s in c.attention_layers)
            if type(s) is type(a)]  # fmt: skip

    def values(key: str) -> str:
        seen = list(dict.fromkeys(getattr(s, key) for s in same))
        return "/".join(f"{v:g}" if isinstance(v, float) else str(v) for v in seen)

    if hasattr(a, "num_kv_heads"):
        kv, dim = values("num_kv_heads"), values("head_dim")
        return f"{a.num_heads} heads, {kv} kv heads, head_dim {dim}"
    keys = [k for k, v in vars(a).items() if k != "num_heads" and isinstance(v, int | float | str)]
    return ", ".join([f"{a.num_heads} heads"] + [f"{k} {values(k)}" for k in keys])


def list_models(args: argparse.Namespace) -> None:
    from core.catalog import named_models
    from core.hub import is_cached

    print(f"{'NAME':<22} {'ARCHITECTURE':<13} {'SIZE':>6}  {'CACHED':<6}  SOURCE")
    for name, entry in named_models().items():
        arch, size = entry.get("architecture", "?"), entry.get("params", "?")
        source = entry.get("repo") or f"pip package {entry.get('package', '?')}"
        cached = "yes" if is_cached(name) else "no"
        print(f"{name:<22} {arch:<13} {size:>6}  {cached:<6}  {source}")


def plugins(args: argparse.Namespace) -> None:
    from core.plugins import describe_plugins, skipped_plugins

    for row in describe_plugins():
        print(f"{row['name']}  ({row['distribution']} {row['version']})")
        for kind, names in row["registers"].items():
            print(f"    {kind}: {', '.join(names)}")
    for p in skipped_plugins():
        print(f"{p.name}  ({p.distribution} {p.version})  skipped: {p.skipped}")
