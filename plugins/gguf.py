"""The GGUF checkpoint format (llama.cpp's single-file models), read with the `gguf` package.

The file is presented to the core as if it were a hub folder: `config()` is a config.json built
from the `{arch}.*` metadata, tensor names are the hub's (`blk.0.attn_q.weight` ->
`model.layers.0.self_attn.q_proj.weight`), tensors come back as floats or, for linear weights,
as their blocks repacked (`read_quantized`, plugins/gguf_quant.py), and the tokenizer is
rebuilt from the vocabulary (see plugins/gguf_tokenizer.py). llama.cpp stores Llama's q/k rows
permuted for its rope kernel; `read()` undoes that, exactly as transformers' GGUF loader does.
Where the converter split one hub tensor in two (gpt-oss's interleaved gate_up), both file
tensors carry the hub's name and `read()` interleaves their rows again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.errors import CheckpointError, ConfigError
from core.hookspecs import hookimpl
from plugins.gguf_reader import GGUFFile

if TYPE_CHECKING:  # torch loads only when a model is built: listing plugins stays light
    import torch

    from kernels.qweight import QuantWeight


@dataclass(frozen=True)
class Arch:
    """How one `general.architecture` of llama.cpp's maps onto a hub checkpoint."""

    model_type: str  # the hub's model_type (config.json)
    permuted: bool = False  # llama.cpp stored the q/k rows in its own rope order
    tensors: dict[str, str] = field(default_factory=dict)  # beside TENSOR_NAMES
    config: dict[str, str] = field(default_factory=dict)  # beside CONFIG_KEYS: {arch}.key -> key
    defaults: dict[str, Any] = field(default_factory=dict)  # what llama.cpp implies, not stores
    moe: Arch | None = None  # what the architecture is when the file has experts (llama: Mixtral)
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # implied beside a stored scaling


# llama.cpp tensor name (layer index as {}) -> hub name; unlisted names pass through unchanged
# (and the loader reports them as unexpected). Stacked experts (`_exps`, (experts, rows, cols))
# become the hub's one tensor per expert ({e}), each read as its slice of the stack. A key may
# name a whole tensor, leaf included, whose hub name has no `.weight` (looked up first). Two
# file tensors given one hub name make it with their rows alternating, in the keys' order.
TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{}.attn_norm": "model.layers.{}.input_layernorm",
    "blk.{}.attn_q": "model.layers.{}.self_attn.q_proj",
    "blk.{}.attn_k": "model.layers.{}.self_attn.k_proj",
    "blk.{}.attn_v": "model.layers.{}.self_attn.v_proj",
    "blk.{}.attn_output": "model.layers.{}.self_attn.o_proj",
    "blk.{}.attn_q_norm": "model.layers.{}.self_attn.q_norm",
    "blk.{}.attn_k_norm": "model.layers.{}.self_attn.k_norm",
    "blk.{}.ffn_norm": "model.layers.{}.post_attention_layernorm",
    "blk.{}.ffn_gate": "model.layers.{}.mlp.gate_proj",
    "blk.{}.ffn_up": "model.layers.{}.mlp.up_proj",
    "blk.{}.ffn_down": "model.layers.{}.mlp.down_proj",
}
EXPERTS = {  # a MoE MLP's router and routed experts, under Qwen's and DeepSeek's hub names
    "blk.{}.ffn_gate_inp": "model.layers.{}.mlp.gate",
    "blk.{}.ffn_gate_exps": "model.layers.{}.mlp.experts.{e}.gate_proj",
    "blk.{}.ffn_up_exps": "model.layers.{}.mlp.experts.{e}.up_proj",
    "blk.{}.ffn_down_exps": "model.layers.{}.mlp.experts.{e}.down_proj",
}
MOE_KEYS = {
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}
MIXTRAL = {  # Mixtral's hub names: w1 gate, w3 up, w2 down
    "blk.{}.ffn_gate_inp": "model.layers.{}.block_sparse_moe.gate",
    "blk.{}.ffn_gate_exps": "model.layers.{}.block_sparse_moe.experts.{e}.w1",
    "blk.{}.ffn_up_exps": "model.layers.{}.block_sparse_moe.experts.{e}.w3",
    "blk.{}.ffn_down_exps": "model.layers.{}.block_sparse_moe.experts.{e}.w2",
}
GPT_OSS = {  # transformers' names; the experts under the released checkpoint's (E, out, in) ones
    "blk.{}.post_attention_norm": "model.layers.{}.post_attention_layernorm",
    "blk.{}.attn_sinks.weight": "model.layers.{}.self_attn.sinks",
    "blk.{}.ffn_gate_inp": "model.layers.{}.mlp.router",
    # the converter splits the hub's interleaved (gate, up) rows into gate and up, MXFP4 ones
    # repacked (read dequantized), float ones transposed to (E, out, in), as `_blocks` are
    "blk.{}.ffn_gate_exps.weight": "model.layers.{}.mlp.experts.gate_up_proj_blocks",
    "blk.{}.ffn_up_exps.weight": "model.layers.{}.mlp.experts.gate_up_proj_blocks",
    "blk.{}.ffn_gate_exps.bias": "model.layers.{}.mlp.experts.gate_up_proj_bias",
    "blk.{}.ffn_up_exps.bias": "model.layers.{}.mlp.experts.gate_up_proj_bias",
    "blk.{}.ffn_down_exps.weight": "model.layers.{}.mlp.experts.down_proj_blocks",
    "blk.{}.ffn_down_exps.bias": "model.layers.{}.mlp.experts.down_proj_bias",
}
ARCHITECTURES = {
    # Llama 2/3, SmolLM2, Mistral; with experts, Mixtral (llama.cpp writes both as `llama`)
    "llama": Arch(
        "llama",
        permuted=True,
        moe=Arch(
            "mixtral",
            permuted=True,
            tensors=MIXTRAL,
            config={"expert_count": "num_local_experts", **MOE_KEYS},
        ),
    ),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3"),
    # llama.cpp's qwen3moe graph always renormalizes the chosen experts' weights
    "qwen3moe": Arch(
        "qwen3_moe",
        tensors=EXPERTS,
        config={"expert_count": "num_experts", **MOE_KEYS},
        defaults={"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    ),
    # llama.cpp runs every 4th layer without rope (its own constant, as transformers' default)
    "smollm3": Arch("smollm3", permuted=True, defaults={"no_rope_layer_interval": 4}),
    # llama.cpp's graph hard-codes gpt-oss's SwiGLU (alpha 1.702, clamped at 7) and slides every
    # even layer (set_swa_pattern(2): GptOssConfig's default without layer_types). Its yarn
    # rounds the correction range; the model's own (OpenAI's, transformers') does not.
    "gpt-oss": Arch(
        "gpt_oss",
        tensors=GPT_OSS,
        config={
            "attention.sliding_window": "sliding_window",
            "expert_count": "num_local_experts",
            "expert_used_count": "num_experts_per_tok",
        },
        defaults={"swiglu_alpha": 1.702, "swiglu_limit": 7.0},
        rope_scaling={"truncate": False},
    ),
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+ rope scaling, stored as per-frequency factors

# {arch}.<key> -> config.json key
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
# general.file_type (llama.cpp's llama_ftype) -> torch_dtype; block formats: bfloat16
FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def hub_names(name: str, tensors: dict[str, str], experts: int = 0) -> list[tuple[str, int | None]]:
    """`blk.3.attn_q.weight` -> [(`model.layers.3.self_attn.q_proj.weight`, None)] (a whole-name
    key: `blk.3.attn_sinks.weight` -> `model.layers.3.self_attn.sinks`); a stack of experts ->
    [(expert e's hub name, e) for each of the `experts`]."""
    module, _, leaf = name.rpartition(".")
    parts = module.split(".")
    layer = [p for p in parts if p.isdigit()]
    whole = tensors.get(_template(name))
    if whole is not None:
        return [(whole.format(*layer), None)]
    target = tensors.get(_template(module))
    if target is None:
        return [(name, None)]
    if "{e}" not in target:
        return [(f"{target.format(*layer)}.{leaf}", None)]
    return [(f"{target.format(*layer, e=e)}.{leaf}", e) for e in range(experts)]


def _template(name: str) -> str:
    return ".".join("{}" if p.isdigit() else p for p in name.split("."))


def _rows(name: str) -> int:
    """The axis of a file tensor's rows, which interleaving alternates (row i of part k of n
    becomes row i * n + k): a weight's -2, a bias's -1."""
    return -1 if name.endswith(".bias") else -2


class GGUFCheckpoint:
    def __init__(self, path: Path):
        self.path = path
        self.file = GGUFFile(path)
        meta = self.file.metadata
        if int(meta.get("split.count", 1)) > 1:
            raise CheckpointError(
                f"{path}: is one of {meta['split.count']} split GGUF files; merge them first "
                "with llama.cpp's `llama-gguf-split --merge`"
            )
        self.arch = str(meta.get("general.architecture", ""))
        if not self.arch:
            raise ConfigError(f"{path}: GGUF metadata lacks 'general.architecture'")
        if self.arch not in ARCHITECTURES:
            raise ConfigError(
                f"{path}: GGUF architecture {self.arch!r} is not supported; Zoo reads GGUF files "
                f"of {', '.join(sorted(ARCHITECTURES))} (other checkpoints of a built-in family "
                "load from their safetensors folder or hub repo)"
            )
        self.spec = ARCHITECTURES[self.arch]
        experts = int(self._meta("expert_count", 0) or 0)
        if experts and self.spec.moe is not None:
            self.spec = self.spec.moe
        tensors = {**TENSOR_NAMES, **self.spec.tensors}
        self._names: dict[str, str] = {}  # hub name -> the file's (the first, of several)
        self._parts: dict[str, list[str]] = {}  # hub name -> the file's, rows interleaved
        self._expert: dict[str, int] = {}  # hub name -> its expert's index in a stacked tensor
        for n in self.file.tensors:
            if n == ROPE_FREQS:
                continue
            for hub, e in hub_names(n, tensors, experts):
                self._parts.setdefault(hub, []).append(n)
                if e is not None:
                    self._expert[hub] = e
        for hub, files in list(self._parts.items()):
            if len(files) > 1:  # in the order of their keys (whole names, as gpt-oss's are)
                files.sort(key=lambda n: list(tensors).index(_template(n)))
            else:
                del self._parts[hub]
            self._names[hub] = files[0]
        self._config: dict[str, Any] | None = None

    def _meta(self, key: str, default: Any = None) -> Any:
        return self.file.metadata.get(f"{self.arch}.{key}", default)

    def config(self) -> dict[str, Any]:
        if self._config is None:
            self._config = self._build_config()
        return self._config

    def _build_config(self) -> dict[str, Any]:
        meta = self.file.metadata
        cfg: dict[str, Any] = {"model_type": self.spec.model_type, **self.spec.defaults}
        keys = {**CONFIG_KEYS, **self.spec.config}
        cfg.update({hub: self._meta(key) for key, hub in keys.items() if self._meta(key)})
        if "head_dim" not in cfg and self._meta("rope.dimension_count"):
            cfg["head_dim"] = self._meta("rope.dimension_count")  # as transformers reads it
        if "vocab_size" not in cfg:  # older files: the vocabulary's or the embedding's length
            embd = self.file.tensors.get("token_embd.weight")
            cfg["vocab_size"] = len(meta.get("tokenizer.ggml.tokens") or ()) or (
                embd.shape[0] if embd else None
            )
        cfg["rope_scaling"] = self._rope_scaling(cfg)
        cfg["tie_word_embeddings"] = "output.weight" not in self.file.tensors
        cfg["attention_bias"] = "blk.0.attn_q.bias" in self.file.tensors
        cfg["torch_dtype"] = FILE_DTYPES.get(meta.get("general.file_type"), "bfloat16")
        gen = self.generation_config()
        cfg.update({k: v for k, v in gen.items() if k in ("bos_token_id", "eos_token_id")})
        return {k: v for k, v in cfg.items() if v is not None}

    def _rope_scaling(self, cfg: dict[str, Any]) -> dict[str, Any] | None:
        kind = self._meta("rope.scaling.type")
        if kind in ("linear", "yarn"):
            out = {"rope_type": kind, **self.spec.rope_scaling}
            out["factor"] = self._meta("rope.scaling.factor")
            if self._meta("rope.scaling.original_context_length"):
                out["original_max_position_embeddings"] = self._meta(
                    "rope.scaling.original_context_length"
                )
            for key in ("beta_fast", "beta_slow"):
                if self._meta(f"rope.scaling.yarn_{key}"):
                    out[key] = self._meta(f"rope.scaling.yarn_{key}")
            return out
        if kind not in (None, "none"):
            raise ConfigError(f"{self.path}: unsupported {self.arch}.rope.scaling.type {kind!r}")
        if ROPE_FREQS not in self.file.tensors:
            return None
        heads = cfg.get("num_attention_heads") or 1  # missing fields fail validation later
        dim = self._meta("rope.dimension_count") or cfg.get("head_dim")
        dim = dim or cfg.get("hidden_size", 0) // heads
        factors = self.file.read(ROPE_FREQS).double().numpy()
        return llama3_rope_scaling(factors, cfg.get("rope_theta", 10000.0), dim, self.path)

    def generation_config(self) -> dict[str, Any]:
        meta = self.file.metadata
        eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        eos = list(dict.fromkeys(i for i in eos if i is not None))  # in order, once each
        out: dict[str, Any] = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id")}
        out["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        return {k: v for k, v in out.items() if v is not None}

    def tensor_names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        shape = list(self.file.tensors[self._names[name]].shape)
        if name in self._parts:
            shape[_rows(self._names[name])] *= len(self._parts[name])
        return tuple(shape[1:] if name in self._expert else shape)

    def read(self, name: str) -> torch.Tensor:
        import torch

        e = self._expert.get(name)
        if name in self._parts:
            parts = [self.file.read(n, e) for n in self._parts[name]]
            return torch.stack(parts, _rows(self._names[name])).reshape(self.shape(name))
        return self._unpermuted(name, self.file.read(self._names[name], e))

    def _files(self, name: str) -> list[str]:
        """The file's tensors that make the hub's `name`: one, or those interleaved."""
        return self._parts.get(name) or [self._names[name]]

    def stored_name(self, name: str) -> str:
        """The file's own name for a tensor (`output.weight` for `lm_head.weight`; one expert
        of a stack: `blk.0.ffn_up_exps.weight[5]`; interleaved ones joined by `+`)."""
        e = self._expert.get(name)
        return "+".join(n + ("" if e is None else f"[{e}]") for n in self._files(name))

    def quant_format(self, name: str) -> str | None:
        """The tensor's block format (`q4_k`, `mxfp4`), or None for floats (F32, F16, BF16) and
        for interleaved tensors stored in different formats (read only as floats)."""
        kinds = {self.file.type_name(n).lower() for n in self._files(name)}
        return None if len(kinds) > 1 or kinds <= {"f32", "f16", "bf16"} else kinds.pop()

    def blocks(self, name: str) -> tuple[str, np.ndarray, np.ndarray | None]:
        """The tensor's block format, its bytes as stored ((rows, bytes per row) uint8, memory-
        mapped; a copy where interleaved) and the stored row of each row of the hub's tensor
        (None: the same order)."""
        import torch

        info = self.file.tensors[self._names[name]]
        order = None
        if self._permuted(name):
            order = self._unpermuted(name, torch.arange(info.shape[0])).numpy()
        return self.quant_format(name), self._raw(name), order

    def stored_bytes(self, name: str) -> int:
        """The tensor's bytes in the file (its blocks, or floats)."""
        infos = [self.file.tensors[n] for n in self._files(name)]
        return sum(i.nbytes // i.shape[0] if name in self._expert else i.nbytes for i in infos)

    def release(self, name: str) -> None:
        """The tensor's pages may leave this process's resident memory (their blocks were
        copied); see GGUFFile.release."""
        for n in self._files(name):
            self.file.release(n)

    def read_quantized(self, name: str) -> QuantWeight:
        """The tensor's blocks as a `QuantWeight` (lossless; see plugins/gguf_quant.py)."""
        import torch

        from plugins.gguf_quant import repack

        raw = torch.from_numpy(np.array(self._raw(name)))  # (rows, bytes per row)
        raw = self._unpermuted(name, raw).numpy()
        return repack(self.quant_format(name), raw, self.shape(name))

    def _raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (its expert's, of a stack), memory-mapped; interleaved
        ones (a matrix's rows of blocks: weights only) copied into the hub's row order. What
        `blocks` and `read_quantized` take; MXFP4's are ggml's `block_mxfp4` (an e8m0 scale
        byte, then 16 bytes: value j in the low nibble, j + 16 in the high one), not the hub's
        (plugins/safetensors_mxfp4.py), and `read` dequantizes them with the `gguf` package."""
        raws = [self.file.raw(n) for n in self._files(name)]
        if name in self._expert:
            raws = [raw[self._expert[name]] for raw in raws]
        if len(raws) == 1:
            return raws[0]
        return np.stack(raws, -2).reshape(*raws[0].shape[:-2], -1, raws[0].shape[-1])

    def _permuted(self, name: str) -> bool:
        """Whether llama.cpp stored this tensor's rows in its own q/k order."""
        gguf_name = self._names[name]
        return self.spec.permuted and (".attn_q." in gguf_name or ".attn_k." in gguf_name)

    def _unpermuted(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """Undo llama.cpp's q/k row order (rows are whole: floats or a row's blocks alike)."""
        gguf_name = self._names[name]
        if self._permuted(name):
            cfg = self.config()
            heads = cfg["num_attention_heads"]
            if ".attn_k." in gguf_name:
                heads = cfg.get("num_key_value_heads", heads)
            w = unpermute(w, heads)
        return w

    def tokenizer(self):
        from plugins.gguf_tokenizer import build_tokenizer

        return build_tokenizer(self.file.metadata, self.path)

    def close(self) -> None:
        self.file.close()


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `LlamaModel.permute`: each head's rows were reordered from the hub's
    (2 halves, d/2) rotary layout to interleaved pairs (d/2, 2); swap them back."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def llama3_rope_scaling(
    factors: np.ndarray, theta: float, dim: int, path: Path
) -> dict[str, Any] | None:
    """The `rope_type: llama3` parameters behind llama.cpp's `rope_freqs` tensor.

    llama.cpp divides each rope frequency by a factor: 1 at high frequencies, `factor` at low
    ones, and 1 / ((1 - s) / factor + s) in between, with s linear in 1 / wavelength. Only that
    line matters, so low_freq_factor is fixed at 1 and the rest fitted; the result is checked.
    """
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    s = (1 / factors - 1 / factor) / (1 - 1 / factor)  # 1: high frequency, 0: low
    mid = (s > 1e-4) & (s < 1 - 1e-4)
    lo, hi = 1.0, 4.0  # Llama 3.x's values, kept unless the smooth band says otherwise
    if mid.sum() >= 2:  # s = (L / wavelen - lo) / (hi - lo)
        slope, icpt = np.polyfit(1 / wavelen[mid], s[mid], 1)
        hi, orig = 1 - 1 / icpt, -slope / icpt
    elif mid.any():
        orig = float(np.median(wavelen[mid] * (lo + s[mid] * (hi - lo))))
    else:  # any length between the last unscaled and the first fully scaled wavelength
        orig = float(np.sqrt(hi * wavelen[s >= 1].max(initial=1.0) * wavelen[s <= 0].min()))
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": lo,
        "high_freq_factor": float(hi),
        "original_max_position_embeddings": round(orig),
    }
    if not np.allclose(_llama3_factors(params, wavelen), factors, rtol=1e-3):
        raise ConfigError(
            f"{path}: {ROPE_FREQS} holds rope frequency factors that match no llama3 rope "
            "scaling; this kind of rope scaling is not supported"
        )
    return params


def _llama3_factors(p: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    """What llama.cpp's converter writes for these llama3 parameters (convert_hf_to_gguf.py)."""
    orig, lo, hi = (
        p["original_max_position_embeddings"],
        p["low_freq_factor"],
        p["high_freq_factor"],
    )
    s = np.clip((orig / wavelen - lo) / (hi - lo), 0.0, 1.0)
    return 1 / ((1 - s) / p["factor"] + s)


def _detect(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


@hookimpl
def zoo_register_formats(registry):
    registry.add_format("gguf", detect=_detect, open=GGUFCheckpoint)
