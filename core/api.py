"""`load_model`: a name or path -> a ready `Model` (see core/model.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from core.errors import CheckpointError, RequestError
from core.hugepages import keep_freed_memory, move_to_huge_pages
from core.kv_cache import SNAPSHOTS
from core.loader import load_weights, plan_load
from core.model import Model
from core.modeling import CausalLM, kernel_errors
from core.mtp import mtp_network
from core.plugins import registry
from core.quantize import check_kind, held_bytes, quantize_model
from core.speculative import SpecConfig, make_speculator

log = logging.getLogger("zoo")

# The KV cache's length when none is asked for: on GPUs (allocated at once) at most this; on
# CPUs (committed as it fills: core/kv_cache.py) the model's whole context where it fits.
DEFAULT_MAX_SEQ_LEN = 4096
# Of the memory free at load, what the weights and a CPU cache sized by default may take: the
# rest is left to activations, the tokenizer and the system.
FIT_SHARE, FIT_SPARE = 0.9, 512 << 20
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _resolve_path(
    name_or_path: str | Path, revision: str | None = None, offline: bool | None = None
) -> Path:
    """A registry name, local path or hub repo id -> a local folder or file (core/hub.py)."""
    from core.hub import resolve

    return resolve(name_or_path, revision=revision, offline=offline)


def _available_devices() -> list[str]:
    """The devices this torch can run on here, for error messages: cpu, cuda:0 ..., mps."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        found.append("mps")
    return found


def usable_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device, refused (RequestError naming it and what is available) where
    this torch cannot use it: a CUDA device on a CPU-only build or past the GPUs present, an
    unknown name."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    available = _available_devices()
    if dev is not None and dev.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                f"this torch ({torch.__version__}) was built without CUDA"
                if torch.version.cuda is None
                else "no CUDA GPU is visible (drivers, CUDA_VISIBLE_DEVICES)"
            )
        elif (dev.index or 0) >= torch.cuda.device_count():
            why = f"only {torch.cuda.device_count()} CUDA device(s) are present"
        else:
            return dev
    elif dev is not None and dev.type == "mps" and not torch.backends.mps.is_available():
        why = "MPS (Apple GPUs) is not available here"
    elif dev is not None and dev.type in ("cpu", "cuda", "mps", "meta"):
        return dev
    elif dev is not None and getattr(torch, dev.type, None) is not None:
        backend = getattr(torch, dev.type)  # xpu, hpu ...: usable where the backend says so
        if getattr(backend, "is_available", lambda: False)():
            return dev
        why = f"this torch has no {dev.type} device available"
    else:
        why = "it is not a device name torch knows"
    raise RequestError(
        f"device {str(device)!r} cannot be used: {why}; available: {', '.join(available)}"
    )


def resolve_device_dtype(
    device, dtype, ckpt_dtype: str, what: str = "dtype"
) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) a model runs in: the ones asked (a name or a torch.dtype; `what` names
    the argument in errors), else CUDA when present and the checkpoint's dtype there, fp32 on
    the CPU."""
    dev = usable_device(device) if device is not None else None
    dev = dev or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        # the checkpoint's dtype on accelerators; fp32 on the CPU, where half math is slow
        return dev, (_DTYPES[ckpt_dtype] if dev.type != "cpu" else torch.float32)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise RequestError(f"{what} {dtype!r} is not one of {', '.join(_DTYPES)}")
        dtype = _DTYPES[dtype]
    return dev, dtype


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device` (None when unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:  # Linux: what can be allocated without swapping
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _cache_dtype(kv_dtype, dt: torch.dtype, dev: torch.device, quantized: bool) -> torch.dtype:
    """The KV cache's dtype: kv_dtype when given; fp16 on CPUs for quantized weights (half the
    memory and the attention reads, as llama.cpp keeps them); else the model's dtype."""
    if kv_dtype is not None:
        return resolve_device_dtype(dev, kv_dtype, "float32", "kv_dtype")[1]
    return torch.float16 if dev.type == "cpu" and quantized else dt


def _cache_length(
    cfg, weights: int, kv: torch.dtype, dev, batch: int, asked: int | None, snapshots: int = 0
) -> int:
    """max_seq_len: the one asked for; else on CPUs the model's context, or as much of it as
    fits beside the weights (and the recurrent states' `snapshots`); else min(context,
    DEFAULT_MAX_SEQ_LEN)."""
    if asked is not None:
        return asked
    context = cfg.max_position_embeddings
    free = available_memory(dev)
    if dev.type != "cpu" or free is None:
        return min(context, DEFAULT_MAX_SEQ_LEN)
    budget = FIT_SHARE * free - FIT_SPARE - weights - cfg.kv_bytes(kv.itemsize, 0, batch)
    budget -= snapshots * batch * cfg.state_bytes_per_sequence(kv.itemsize)
    per_token = cfg.kv_bytes_per_token(kv.itemsize) * batch
    fits = int(budget // per_token) if per_token else context
    return max(1, min(context, fits))


def _check_fits(
    cfg, weights: int, kv: torch.dtype, device, batch: int, seq: int, snapshots: int
) -> None:
    """Refuse, before reading any weight, weights + a KV cache larger than free memory
    (weights priced in the form they will be held: kept quantized or as floats; recurrent
    states with their snapshots)."""
    free = available_memory(device)
    cache = cfg.kv_bytes(kv.itemsize, seq, batch)  # sliding layers: their window only
    cache += snapshots * batch * cfg.state_bytes_per_sequence(kv.itemsize)
    if free is not None and weights + cache > free:
        gib = 2**30
        raise RequestError(
            f"the KV cache for {batch} x {seq} tokens needs {cache:,} bytes ({cache / gib:.2f} "
            f"GiB) on top of {weights / gib:.2f} GiB of weights, but only {free / gib:.2f} GiB "
            f"is free on {device}; pass a smaller max_seq_len or max_batch_size"
            + (" (or fewer snapshots)" if snapshots and cfg.state_bytes_per_sequence(1) else "")
        )


def _check_finite(net: CausalLM, path: Path) -> None:
    tensors = [*net.named_parameters(), *net.named_buffers()]  # buffers: quantized weights
    bad = [n for n, t in tensors if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise CheckpointError(
            f"{path}: {len(bad)} tensor(s) hold NaN or Inf values: {', '.join(bad[:8])}; "
            "the checkpoint is corrupt or was saved from a diverged run"
        )


def _read_config(ckpt, path: Path):
    """(architecture plugin, RuntimeConfig, source named in errors) of an open checkpoint."""
    raw = ckpt.config()
    source = str(path / "config.json" if path.is_dir() else path)  # GGUF: its metadata
    arch = registry().architecture(raw.get("model_type"), source=source)
    dto = arch.config.from_dict(raw, source=source)
    # a family whose checkpoint names depend on a config key adapts its map (Granite 4.0-H)
    arch = replace(arch, weight_map=dto.adapt_weight_map(arch.weight_map))
    # constant factors folded into weights as they load (Falcon-H1's multipliers)
    arch = replace(arch, scales=dto.weight_scales())
    return arch, dto.to_runtime(), source


def _shard(ckpt, arch, cfg, tp: int, dev: torch.device, source: str, compile: bool, quantize):
    """Join the tensor-parallel group: (sharding, this rank's device, the checkpoint as this
    rank reads it: its own slices only)."""
    from core.parallel.tp import ShardedCheckpoint, tensor_parallel

    sharding, dev = tensor_parallel(cfg, tp, dev, source, compile, quantize)
    return sharding, dev, ShardedCheckpoint(ckpt, arch.weight_map, sharding)


def _check_positive(max_seq_len: int | None, max_batch_size: int, snapshots: int) -> None:
    if (max_seq_len is not None and max_seq_len < 1) or max_batch_size < 1:
        raise RequestError(
            f"max_seq_len ({max_seq_len}) and max_batch_size ({max_batch_size}) must be positive"
        )
    if snapshots < 0:
        raise RequestError(f"snapshots ({snapshots}) must be 0 (off) or more")


def _build_network(cfg, tp: int, sharding) -> CausalLM:
    """The network on the meta device: the whole model, or (tensor parallel) one rank's part."""
    if sharding is not None:
        from core.parallel.tp import local_config, parallelize

        cfg = local_config(cfg, tp)
    with torch.device("meta"):
        net = CausalLM(cfg)
    if sharding is not None:
        parallelize(net, sharding)
    return net


def _fill_network(net, ckpt, arch, plan, dt, dev, keep: bool, quantize) -> None:
    """Read the checkpoint into `net` on `dev` (quantized blocks kept as they are when `keep`),
    then quantize it at load when asked."""
    load_weights(
        net,
        ckpt,
        arch.weight_map,
        dtype=dt,
        device=dev,
        ignore=net.ignored_checkpoint_names(),
        progress=True,
        keep_quantized=keep,
        plan=plan,
        scales=arch.scales,
    )
    if quantize is not None:
        quantize_model(net, quantize)


def _log_loaded(path, cfg, net: CausalLM, dev, dt, kv, batch: int, seq: int, asked, t0: float):
    """The one line that says what was loaded, where, in how long (since `t0`), and how its KV
    cache was sized."""
    how = (
        "asked for"
        if asked is not None
        else (
            "the model's context" if seq == cfg.max_position_embeddings else "what fits in memory"
        )
    )
    lazy = ", committed as it fills" if dev.type == "cpu" else ""
    log.info(
        "zoo: loaded %s (%s) on %s as %s in %.2fs; KV cache %d x %d tokens (%s), %s, %.1f MiB%s",
        path,
        cfg.model_type,
        dev,
        str(dt).removeprefix("torch."),
        time.perf_counter() - t0,
        batch,
        seq,
        how,
        str(kv).removeprefix("torch."),
        net.kv_cache.nbytes / 2**20,
        lazy,
    )


def load_model(
    name_or_path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    max_seq_len: int | None = None,
    max_batch_size: int = 1,
    revision: str | None = None,
    offline: bool | None = None,
    check_finite: bool = False,
    compile: bool = False,
    dequantize: bool = False,
    quantize: str | None = None,
    tp: int = 1,
    kv_dtype: str | torch.dtype | None = None,
    snapshots: int = SNAPSHOTS,
    prefix_cache: bool = True,
    speculative: str | dict | SpecConfig | None = None,
) -> Model:
    """Load a model: a registry name, a local folder or .gguf file, or a hub repo id.

    device: CUDA when available, else CPU. dtype: the checkpoint's on CUDA, float32 on CPU.
    max_seq_len: the KV cache length; by default, on CPUs, the model's context
    (max_position_embeddings) or as much of it as fits in free memory beside the weights (the
    cache's memory is committed as it fills), elsewhere min(max_position_embeddings, 4096).
    revision / offline: for hub downloads. check_finite: refuse weights holding NaN or Inf.
    compile: run decode steps as torch.compile graphs (CUDA graphs on GPUs): faster per token,
    at a one-off compile per batch size and cache bucket (see core/decode_step.py).
    dequantize: turn a GGUF file's quantized blocks into floats of `dtype` (by default they are
    kept as they are: docs/quantization.md). quantize: "int8" or "int4", quantize the float
    weights of any checkpoint at load (linear layers, LM head, embedding).
    tp: split the model over `tp` ranks of a torch.distributed group, this process being one
    (core/parallel/tp.py, docs/scaling.md); every rank calls load_model with the same arguments.
    kv_dtype: the KV cache's dtype; by default float16 on CPUs where weights are kept quantized
    (or quantized at load), else the model's dtype.
    snapshots: per cache row of a model with recurrent layers (gated DeltaNet...), how many
    copies of its state to keep, taken every 256 tokens, from which a later prompt sharing a
    prefix resumes (core/slots.py); 0: none, a prompt then resumes only where a row's whole
    history is its prefix. Each costs the recurrent state's bytes per row (`zoo info`).
    prefix_cache: cache rows keep what they hold between `generate` / `stream` calls, and a
    prompt starts from the longest prefix a row holds (a chat's next turn prefills only its new
    tokens; `Model.prefix_cache` turns it off later too). False: every call prefills its whole
    prompt.
    speculative: decode speculatively (core/speculative.py, docs/speculative.md): "ngram"
    (prompt lookup), "mtp" (the checkpoint's multi-token-prediction layers), or a dict such
    as {"method": "draft", "draft": "smollm2", "k": 4} (a draft model sharing the tokenizer,
    loaded with this model's device, dtype and cache sizes). The same tokens as without it
    (greedy), or the same distribution (sampling), in fewer steps.
    """
    spec = SpecConfig.of(speculative)  # (refused before any download or read)
    if quantize is not None:
        check_kind(quantize)  # before any download or read
    if device is not None:
        usable_device(device)  # (likewise)
    path = _resolve_path(name_or_path, revision=revision, offline=offline)
    ckpt = registry().format_for(path).open(path)
    try:
        arch, cfg, source = _read_config(ckpt, path)
        dev, dt = resolve_device_dtype(device, dtype, cfg.dtype)
        # speculative="mtp": the checkpoint's MTP layer too, loaded the same way (core/mtp.py)
        mtp = mtp_network(cfg, ckpt, source, tp) if spec and spec.method == "mtp" else None
        sharding = None
        if tp != 1:  # a rank's own part of the model and of the checkpoint
            sharding, dev, ckpt = _shard(ckpt, arch, cfg, tp, dev, source, compile, quantize)
        _check_positive(max_seq_len, max_batch_size, snapshots)
        t0 = time.perf_counter()
        net = _build_network(cfg, tp, sharding)
        parts = [p for p in (net, mtp) if p is not None]
        keep = not dequantize and quantize is None and sharding is None
        plans = [plan_load(p, ckpt, arch.weight_map, p.ignored_checkpoint_names()) for p in parts]
        held = [
            held_bytes(p, ckpt, plan, dt, dev, keep) for p, plan in zip(parts, plans, strict=True)
        ]
        weights, kept = sum(w for w, _ in held), sum(k for _, k in held)
        kv = _cache_dtype(kv_dtype, dt, dev, kept > 0 or quantize is not None)
        seq = _cache_length(net.config, weights, kv, dev, max_batch_size, max_seq_len, snapshots)
        _check_fits(net.config, weights, kv, dev, max_batch_size, seq, snapshots)
        for p, plan in zip(parts, plans, strict=True):
            _fill_network(p, ckpt, arch, plan, dt, dev, keep, quantize)
        net.mtp = mtp
        if check_finite:
            _check_finite(net, path)
        if dev.type == "cpu":  # decode streams every weight: fewer TLB misses in 2 MiB pages
            move_to_huge_pages(net)
            keep_freed_memory()  # a prefill's activations: reused, not faulted in each time
        tokenizer = ckpt.tokenizer()
        gen_config = ckpt.generation_config()
    finally:
        ckpt.close()
    net.setup_caches(max_batch_size, seq, kv, snapshots)
    net.eval().requires_grad_(False)  # inference only: no autograd in eager or compiled steps
    _log_loaded(path, cfg, net, dev, dt, kv, max_batch_size, seq, max_seq_len, t0)
    with kernel_errors():  # a compiled step resolves every kernel now (ZOO_KERNELS)
        model = Model(net, tokenizer, path, gen_config, compile=compile, prefix_cache=prefix_cache)
    draft = dict(device=dev, dtype=dt, max_seq_len=seq, max_batch_size=max_batch_size)
    model.speculator = make_speculator(spec, model, **draft)
    return model
