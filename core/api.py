"""`load_model`: a name or path -> a ready `Model` (see core/model.py)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from core.errors import RequestError
from core.loader import load_weights
from core.model import Model
from core.modeling import CausalLM
from core.plugins import registry

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


def load_model(
    name_or_path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    max_seq_len: int | None = None,
    max_batch_size: int = 1,
    revision: str | None = None,
    offline: bool | None = None,
) -> Model:
    """Load a model from a local checkpoint folder.

    device: CUDA when available, else CPU. dtype: the checkpoint's on CUDA, float32 on CPU.
    max_seq_len: the KV cache length, by default min(max_position_embeddings, 4096).
    """
    path = _resolve_path(name_or_path, revision=revision, offline=offline)
    reg = registry()
    ckpt = reg.format_for(path).open(path)
    try:
        raw = ckpt.config()
        source = str(path / "config.json" if path.is_dir() else path)  # GGUF: its metadata
        arch = reg.architecture(raw.get("model_type"), source=source)
        cfg = arch.config.from_dict(raw, source=source).to_runtime()
        dev, dt = _resolve_device_dtype(device, dtype, cfg.dtype)
        seq = max_seq_len or min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        if seq < 1 or max_batch_size < 1:
            raise RequestError(
                f"max_seq_len ({seq}) and max_batch_size ({max_batch_size}) must be positive"
            )
        t0 = time.perf_counter()
        with torch.device("meta"):
            net = CausalLM(cfg)
        load_weights(
            net, ckpt, arch.weight_map, dtype=dt, device=dev, ignore=net.ignored_checkpoint_names()
        )
        tokenizer = ckpt.tokenizer()
        gen_config = ckpt.generation_config()
    finally:
        ckpt.close()
    net.setup_caches(max_batch_size, seq)
    net.eval()
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
    return Model(net, tokenizer, path, gen_config)
