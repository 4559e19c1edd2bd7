"""`load_model`: a name or path -> a ready `Model` (see core/model.py)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from core.errors import CheckpointError, RequestError
from core.hugepages import move_to_huge_pages
from core.loader import load_weights
from core.model import Model
from core.modeling import CausalLM
from core.plugins import registry
from core.quantize import check_kind, quantize_model

log = logging.getLogger("zoo")

DEFAULT_MAX_SEQ_LEN = 4096
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _resolve_path(
    name_or_path: str | Path, revision: str | None = None, offline: bool | None = None
) -> Path:
    """A registry name, local path or hub repo id -> a local folder or file (core/hub.py)."""
    from core.hub import resolve

    return resolve(name_or_path, revision=revision, offline=offline)


def _resolve_device_dtype(device, dtype, ckpt_dtype: str) -> tuple[torch.device, torch.dtype]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        # the checkpoint's dtype on accelerators; fp32 on the CPU, where half math is slow
        return dev, (_DTYPES[ckpt_dtype] if dev.type != "cpu" else torch.float32)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise RequestError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
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


def _check_fits(net: CausalLM, cfg, dtype, device, batch: int, seq: int) -> None:
    """Refuse, before reading any weight, a model + KV cache larger than free memory."""
    free = available_memory(device)
    weights = sum(p.numel() for p in net.parameters()) * dtype.itemsize
    cache = cfg.kv_bytes(dtype.itemsize, seq, batch)  # sliding layers: their window only
    if free is not None and weights + cache > free:
        gib = 2**30
        raise RequestError(
            f"the KV cache for {batch} x {seq} tokens needs {cache:,} bytes ({cache / gib:.2f} "
            f"GiB) on top of {weights / gib:.2f} GiB of weights, but only {free / gib:.2f} GiB "
            f"is free on {device}; pass a smaller max_seq_len or max_batch_size"
        )


def _check_finite(net: CausalLM, path: Path) -> None:
    tensors = [*net.named_parameters(), *net.named_buffers()]  # buffers: quantized weights
    bad = [n for n, t in tensors if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise CheckpointError(
            f"{path}: {len(bad)} tensor(s) hold NaN or Inf values: {', '.join(bad[:8])}; "
            "the checkpoint is corrupt or was saved from a diverged run"
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
) -> Model:
    """Load a model: a registry name, a local folder or .gguf file, or a hub repo id.

    device: CUDA when available, else CPU. dtype: the checkpoint's on CUDA, float32 on CPU.
    max_seq_len: the KV cache length, by default min(max_position_embeddings, 4096).
    revision / offline: for hub downloads. check_finite: refuse weights holding NaN or Inf.
    compile: run decode steps as torch.compile graphs (CUDA graphs on GPUs): faster per token,
    at a one-off compile per batch size and cache bucket (see core/decode_step.py).
    dequantize: turn a GGUF file's quantized blocks into floats of `dtype` (by default they are
    kept as they are: docs/quantization.md). quantize: "int8" or "int4", quantize the float
    weights of any checkpoint at load (linear layers, LM head, embedding).
    tp: split the model over `tp` ranks of a torch.distributed group, this process being one
    (core/tp.py, docs/scaling.md); every rank calls load_model with the same arguments.
    """
    if quantize is not None:
        check_kind(quantize)  # before any download or read
    path = _resolve_path(name_or_path, revision=revision, offline=offline)
    reg = registry()
    ckpt = reg.format_for(path).open(path)
    try:
        raw = ckpt.config()
        source = str(path / "config.json" if path.is_dir() else path)  # GGUF: its metadata
        arch = reg.architecture(raw.get("model_type"), source=source)
        cfg = arch.config.from_dict(raw, source=source).to_runtime()
        dev, dt = _resolve_device_dtype(device, dtype, cfg.dtype)
        sharding = None
        if tp != 1:  # a rank's own part of the model and of the checkpoint
            from core.tp import ShardedCheckpoint, local_config, parallelize, tensor_parallel

            sharding, dev = tensor_parallel(cfg, tp, dev, source, compile, quantize)
            ckpt = ShardedCheckpoint(ckpt, arch.weight_map, sharding)
        seq = max_seq_len or min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        if seq < 1 or max_batch_size < 1:
            raise RequestError(
                f"max_seq_len ({seq}) and max_batch_size ({max_batch_size}) must be positive"
            )
        t0 = time.perf_counter()
        with torch.device("meta"):
            net = CausalLM(cfg if sharding is None else local_config(cfg, tp))
        if sharding is not None:
            parallelize(net, sharding)
        _check_fits(net, net.config, dt, dev, max_batch_size, seq)
        load_weights(
            net,
            ckpt,
            arch.weight_map,
            dtype=dt,
            device=dev,
            ignore=net.ignored_checkpoint_names(),
            progress=True,
            keep_quantized=not dequantize and quantize is None and sharding is None,
        )
        if quantize is not None:
            quantize_model(net, quantize)
        if check_finite:
            _check_finite(net, path)
        if dev.type == "cpu":  # decode streams every weight: fewer TLB misses in 2 MiB pages
            move_to_huge_pages(net)
        tokenizer = ckpt.tokenizer()
        gen_config = ckpt.generation_config()
    finally:
        ckpt.close()
    net.setup_caches(max_batch_size, seq)
    net.eval().requires_grad_(False)  # inference only: no autograd in eager or compiled steps
    log.info(
        "zoo: loaded %s (%s) on %s as %s in %.2fs; KV cache %d x %d tokens = %.1f MiB",
        path,
        cfg.model_type,
        dev,
        str(dt).removeprefix("torch."),
        time.perf_counter() - t0,
        max_batch_size,
        seq,
        net.kv_cache.nbytes / 2**20,
    )
    return Model(net, tokenizer, path, gen_config, compile=compile)
