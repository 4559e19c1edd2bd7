"""The public entry points: `load_model` and the `Model` it returns."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from core.config import RuntimeConfig
from core.errors import HubError, RequestError
from core.generation import GenerationResult, sample
from core.loader import load_weights
from core.modeling import CausalLM
from core.plugins import registry
from core.tokenizer import Tokenizer

log = logging.getLogger("zoo")

DEFAULT_MAX_SEQ_LEN = 4096
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Model:
    """A loaded model with its static KV cache. Not thread-safe: one caller at a time."""

    def __init__(self, net: CausalLM, tokenizer: Tokenizer | None, path: Path):
        self.net = net
        self.config: RuntimeConfig = net.config
        self.tokenizer = tokenizer
        self.path = path
        self.eos_token_ids: set[int] = set(self.config.eos_token_ids)  # generation stops on these

    @property
    def device(self) -> torch.device:
        return self.net.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.net.model.embed_tokens.weight.dtype

    @property
    def max_seq_len(self) -> int:
        return self.net.kv_cache.max_seq_len

    @property
    def max_batch_size(self) -> int:
        return self.net.kv_cache.max_batch_size

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """Logits (B, T, vocab) for input_ids (B, T) at positions start_pos.., filling the cache."""
        b, t = input_ids.shape
        if b > self.max_batch_size:
            raise RequestError(
                f"batch of {b} exceeds max_batch_size={self.max_batch_size}; "
                f"pass load_model(..., max_batch_size={b})"
            )
        if start_pos + t > self.max_seq_len:
            raise RequestError(
                f"positions up to {start_pos + t} exceed the KV cache (max_seq_len="
                f"{self.max_seq_len}); pass load_model(..., max_seq_len={start_pos + t})"
            )
        return self.net(input_ids.to(self.device), start_pos)

    def reset(self) -> None:
        """Clear the KV cache."""
        self.net.kv_cache.reset()

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> GenerationResult:
        """Continue `prompt` (token ids) by up to `max_new_tokens`, stopping at an eos token."""
        ids = [int(i) for i in prompt]
        if not ids:
            raise RequestError("prompt is empty; pass at least one token id")
        if max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {temperature}")
        need = len(ids) + max_new_tokens
        if need > self.max_seq_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {need} "
                f"exceeds the KV cache (max_seq_len={self.max_seq_len}); "
                f"pass load_model(..., max_seq_len={need})"
            )
        gen = torch.Generator(self.device).manual_seed(seed) if seed is not None else None
        eos = self.eos_token_ids
        t0 = time.perf_counter()
        logits = self.forward(torch.tensor([ids]), 0)[:, -1]
        out, finish = [], "length"
        t1 = time.perf_counter()
        for _ in range(max_new_tokens):
            tok = sample(logits, temperature, gen)
            out.append(int(tok))
            if out[-1] in eos:
                finish = "stop"
                break
            if len(out) == max_new_tokens:
                break
            logits = self.forward(tok[:, None], len(ids) + len(out) - 1)[:, -1]
        t2 = time.perf_counter()
        text = self.tokenizer.decode(out) if self.tokenizer else ""
        return GenerationResult(
            out,
            text,
            finish,
            prompt_tokens=len(ids),
            timings={"prefill_s": t1 - t0, "decode_s": t2 - t1},
        )


def _resolve_path(name_or_path: str | Path) -> Path:
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    raise HubError(
        f"{str(name_or_path)!r} is not a local folder or file; loading from the Hugging Face hub "
        "is not supported yet: download the repo and pass its folder"
    )


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
) -> Model:
    """Load a model from a local checkpoint folder.

    device: CUDA when available, else CPU. dtype: the checkpoint's on CUDA, float32 on CPU.
    max_seq_len: the KV cache length, by default min(max_position_embeddings, 4096).
    """
    del revision  # used by hub downloads, which arrive with the hub issue
    path = _resolve_path(name_or_path)
    reg = registry()
    ckpt = reg.format_for(path).open(path)
    try:
        raw = ckpt.config()
        arch = reg.architecture(raw.get("model_type"), source=str(path / "config.json"))
        cfg = arch.config.from_dict(raw, source=str(path / "config.json")).to_runtime()
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
    tokenizer = Tokenizer.from_folder(path) if path.is_dir() else None
    return Model(net, tokenizer, path)
