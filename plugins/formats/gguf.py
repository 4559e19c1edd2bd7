"""The GGUF checkpoint format (llama.cpp's single-file models), read with the `gguf` package.

The file is presented to the core as if it were a hub folder: `config()` is a config.json built
from the `{arch}.*` metadata, tensor names are the hub's (`blk.0.attn_q.weight` ->
`model.layers.0.self_attn.q_proj.weight`), tensors come back as floats or, for linear weights,
as their blocks repacked (`read_quantized`, gguf_quant.py), and the tokenizer is
rebuilt from the vocabulary (see gguf_tokenizer.py). llama.cpp stores Llama's q/k rows
permuted for its rope kernel, and Gemma's (1 + w) norm weights as 1 + w; `read()` undoes both (the
permutation exactly as transformers' GGUF loader does). A hub tensor llama.cpp splits (DeepSeek's
MLA `kv_b_proj`) is joined back on read (`Join`); where it split one hub tensor's rows in two
(gpt-oss's interleaved gate_up), both file tensors carry the hub's name and `read()` interleaves
their rows again. Whatever else the converter did to a tensor (Qwen3-Next's and Qwen3.5's
DeltaNet tensors: values transformed, rows or columns reordered, one hub tensor's rows split in
two) its `Fix` undoes (gguf_fixes.py); multi-token-prediction blocks are skipped.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.errors import CheckpointError, ConfigError
from core.hookspecs import hookimpl
from plugins.formats.gguf_archs import (
    ARCHITECTURES,
    CONFIG_KEYS,
    FILE_DTYPES,
    LONG_FACTORS,
    ROPE_FREQS,
    ROPE_TENSORS,
    SHORT_FACTORS,
    TENSOR_NAMES,
    Join,
)
from plugins.formats.gguf_fixes import Fix
from plugins.formats.gguf_reader import GGUFFile
from plugins.formats.gguf_rope import llama3_rope_scaling, rotary_factor, unpermute

if TYPE_CHECKING:  # torch loads only when a model is built: listing plugins stays light
    import torch

    from kernels.qweight import QuantExperts, QuantWeight


def hub_names(name: str, tensors: dict[str, str], experts: int = 0) -> list[tuple[str, int | None]]:
    """`blk.3.attn_q.weight` -> [(`model.layers.3.self_attn.q_proj.weight`, None)]; a stack of
    experts -> [(expert e's hub name, e) for each of the `experts`]."""
    key, layer, leaf = _template(name)
    if f"{key}.{leaf}" in tensors:  # a whole name: the hub's leaf is not the file's
        return [(tensors[f"{key}.{leaf}"].format(*layer), None)]
    target = tensors.get(key)
    if target is None:
        return [(name, None)]
    if "{e}" not in target:
        return [(f"{target.format(*layer)}.{leaf}", None)]
    return [(f"{target.format(*layer, e=e)}.{leaf}", e) for e in range(experts)]


def _template(name: str) -> tuple[str, list[str], str]:
    """`blk.3.attn_q.weight` -> (`blk.{}.attn_q`, ["3"], `weight`)."""
    module, _, leaf = name.rpartition(".")
    parts = module.split(".")
    key = ".".join("{}" if p.isdigit() else p for p in parts)
    return key, [p for p in parts if p.isdigit()], leaf


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
        self._interleaved: dict[str, list[str]] = {}  # hub name -> the file's, rows alternating
        self._expert: dict[str, int] = {}  # hub name -> its expert's index in a stacked tensor
        part_of = {p: hub for hub, j in self.spec.joins.items() for p in j.parts}
        self._joined: dict[str, tuple[Join, dict[str, str]]] = {}  # hub -> (join, part -> file's)
        self._fixes: dict[str, Fix] = {}  # hub name -> what the converter did to it
        self._fused: dict[str, list[str]] = {}  # hub name -> the file's (Fix.fused), rows stacked
        fused = {t for fix in self.spec.fixes.values() for t in fix.fused}
        mtp = int(self._meta("nextn_predict_layers", 0) or 0)
        layers = int(self._meta("block_count", 0) or 0) - mtp
        for n in self.file.tensors:
            if n in ROPE_TENSORS:
                continue
            key, layer, leaf = _template(n)
            if mtp and n.startswith("blk.") and int(layer[0]) >= layers:
                self._names[f"mtp.{n}"] = n  # multi-token prediction: the hub's mtp.*, not run
                continue
            if key in part_of:
                hub = f"{part_of[key].format(*layer)}.{leaf}"
                self._joined.setdefault(hub, (self.spec.joins[part_of[key]], {}))[1][key] = n
                continue
            if key in fused:
                continue  # read with the tensor whose rows it continues
            fix = self.spec.fixes.get(f"{key}.{leaf}", self.spec.fixes.get(key))
            for hub, e in hub_names(n, tensors, experts):
                self._interleaved.setdefault(hub, []).append(n)
                if e is not None:
                    self._expert[hub] = e
                if fix is not None:
                    self._fixes[hub] = fix
                    self._fused[hub] = [n, *(f"{t.format(*layer)}.{leaf}" for t in fix.fused)]
        order = list(tensors)
        for hub, files in list(self._interleaved.items()):
            if len(files) > 1:  # in the order of their keys (whole names, as gpt-oss's are)
                files.sort(key=lambda n: order.index("{}.{}".format(*_template(n)[::2])))
            else:
                del self._interleaved[hub]
            self._names[hub] = files[0]
        self._fused = {hub: files for hub, files in self._fused.items() if len(files) > 1}
        for files in self._fused.values():
            if missing := [n for n in files if n not in self.file.tensors]:
                raise CheckpointError(
                    f"{path}: tensor {files[0]!r} comes with {missing[0]!r}, which the file "
                    "lacks; it is incomplete: convert or download it again"
                )
        for join, found in self._joined.values():
            missing = [p for p in join.parts if p not in found]
            if missing:
                first = next(iter(found.values()))
                _, layer, leaf = _template(first)
                partner = f"{missing[0].format(*layer)}.{leaf}"
                raise CheckpointError(
                    f"{path}: tensor {first!r} comes with {partner!r}, which the file lacks; "
                    "it is incomplete: convert or download it again"
                )
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
        if self._meta("nextn_predict_layers") and "num_hidden_layers" in cfg:
            cfg["num_hidden_layers"] -= self._meta("nextn_predict_layers")  # MTP blocks follow
        rope_dim = self._meta("rope.dimension_count")
        if self.spec.partial_rope and rope_dim:
            cfg["partial_rotary_factor"] = rotary_factor(rope_dim, cfg)
        elif "head_dim" not in cfg and rope_dim:
            cfg["head_dim"] = rope_dim  # as transformers reads it
        if "vocab_size" not in cfg:  # older files: the vocabulary's or the embedding's length
            embd = self.file.tensors.get("token_embd.weight")
            cfg["vocab_size"] = len(meta.get("tokenizer.ggml.tokens") or ()) or (
                embd.shape[0] if embd else None
            )
        cfg["rope_scaling"] = self._rope_scaling(cfg)
        cfg["tie_word_embeddings"] = "output.weight" not in self.file.tensors
        cfg["attention_bias"] = "blk.0.attn_q.bias" in self.file.tensors
        if self.spec.qk_norm_key:
            cfg[self.spec.qk_norm_key] = "blk.0.attn_q_norm.weight" in self.file.tensors
        cfg["torch_dtype"] = FILE_DTYPES.get(meta.get("general.file_type"), "bfloat16")
        gen = self.generation_config()
        cfg.update({k: v for k, v in gen.items() if k in ("bos_token_id", "eos_token_id")})
        cfg = {k: v for k, v in cfg.items() if v is not None}
        return self.spec.configure(self._meta, cfg, self.path) if self.spec.configure else cfg

    def _rope_scaling(self, cfg: dict[str, Any]) -> dict[str, Any] | None:
        kind = self._meta("rope.scaling.type")
        if LONG_FACTORS in self.file.tensors and kind in (None, "none", "longrope"):
            return self._longrope(cfg)
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
        if self.spec.proportional_rope:  # the share of frequencies that turn (factor 1)
            turning = float((factors < 1e29).sum()) / len(factors)
            return {"rope_type": "proportional", "partial_rotary_factor": turning}
        return llama3_rope_scaling(factors, cfg.get("rope_theta", 10000.0), dim, self.path)

    def _longrope(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """LongRoPE's parameters: the factors as stored (float32, each read as the float64 it
        is: Phi-3's hub configs spell them so), the original length, and the attention factor
        where it is not the one the lengths imply (llama.cpp's converter writes that one)."""
        if SHORT_FACTORS not in self.file.tensors:
            raise CheckpointError(
                f"{self.path}: has {LONG_FACTORS} but no {SHORT_FACTORS}; LongRoPE needs both "
                "(convert the checkpoint again with llama.cpp's convert_hf_to_gguf.py)"
            )
        out: dict[str, Any] = {"rope_type": "longrope"}
        for key, name in (("long_factor", LONG_FACTORS), ("short_factor", SHORT_FACTORS)):
            out[key] = self.file.read(name).double().tolist()
        length = cfg.get("max_position_embeddings") or 1  # missing: fails validation later
        orig = out["original_max_position_embeddings"] = (
            cfg.get("original_max_position_embeddings") or length
        )
        stored = self._meta("rope.scaling.attn_factor")
        scale = length / orig
        implied = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
        if stored and np.float32(stored) != np.float32(implied):
            out["attention_factor"] = stored
        return out

    def generation_config(self) -> dict[str, Any]:
        meta = self.file.metadata
        eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        eos = list(dict.fromkeys(i for i in eos if i is not None))  # in order, once each
        out: dict[str, Any] = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id")}
        out["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        return {k: v for k, v in out.items() if v is not None}

    def tensor_names(self) -> list[str]:
        return [*self._names, *self._joined]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._joined:  # joined on the meta device: shapes, no data
            import torch

            parts = [
                torch.empty(self.file.tensors[n].shape, device="meta") for n in self._parts(name)
            ]
            return tuple(self._joined[name][0].join(*parts).shape)
        shape = list(self.file.tensors[self._names[name]].shape)
        if name in self._interleaved:
            shape[_rows(self._names[name])] *= len(self._interleaved[name])
        if name in self._fused:
            shape[0] = sum(self.file.tensors[n].shape[0] for n in self._fused[name])
        if name in self._fixes:  # e.g. a conv's squeezed axis back
            shape = self._fixes[name].shape(shape)
        return tuple(shape[1:] if name in self._expert else shape)

    def read(self, name: str) -> torch.Tensor:
        import torch

        if name in self._joined:
            return self._joined[name][0].join(*(self.file.read(n) for n in self._parts(name)))
        e = self._expert.get(name)
        if name in self._interleaved:
            parts = [self.file.read(n, e) for n in self._interleaved[name]]
            return torch.stack(parts, _rows(self._names[name])).reshape(self.shape(name))
        ws = [self.file.read(n, e) for n in self._files(name)]
        w = ws[0] if len(ws) == 1 else torch.cat(ws)  # fused: rows stacked
        if name in self._fixes:
            return self._fixes[name].floats(w, self.config())
        if self.spec.norm_offset and name.endswith("norm.weight"):  # as the converter added it
            w = w.float() - self.spec.norm_offset
        return self._unpermuted(name, w)

    def _parts(self, name: str) -> list[str]:
        """The file's tensors that a joined hub tensor is made of, in the join's order."""
        join, found = self._joined[name]
        return [found[p] for p in join.parts]

    def _files(self, name: str) -> list[str]:
        """The file's tensors that make the hub's `name`: one, or those interleaved or fused."""
        return self._interleaved.get(name) or self._fused.get(name) or [self._names[name]]

    def stored_name(self, name: str) -> str:
        """The file's own name for a tensor (`output.weight` for `lm_head.weight`; one expert
        of a stack: `blk.0.ffn_up_exps.weight[5]`; joined or interleaved: `a + b`)."""
        if name in self._joined:
            return " + ".join(self._parts(name))
        e = self._expert.get(name)
        return " + ".join(n + ("" if e is None else f"[{e}]") for n in self._files(name))

    def quant_format(self, name: str) -> str | None:
        """The tensor's block format (`q4_k`, `mxfp4`), or None for floats (F32, F16, BF16), for
        joined tensors and for interleaved ones stored in different formats (read as floats)."""
        if name in self._joined:
            return None
        kinds = {self.file.type_name(n).lower() for n in self._files(name)}
        if len(kinds) > 1 or kinds <= {"f32", "f16", "bf16"}:
            return None
        fix, kind = self._fixes.get(name), self.file.tensors[self._names[name]].ggml_type
        return None if fix and not fix.keeps_blocks(self.config(), kind) else kinds.pop()

    def blocks(self, name: str) -> tuple[str, np.ndarray, np.ndarray | None]:
        """The tensor's block format, its bytes as stored ((rows, bytes per row) uint8, memory-
        mapped; a copy where interleaved) and the stored row of each row of the hub's tensor
        (None: the same order)."""
        import torch

        info = self.file.tensors[self._names[name]]
        order = None
        if self._permuted(name):
            order = self._unpermuted(name, torch.arange(info.shape[0])).numpy()
        if (fix := self._fixes.get(name)) is not None and fix.rows is not None:
            order = fix.rows(self.config())
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

    def read_quantized(self, name: str) -> QuantWeight | QuantExperts:
        """The tensor's blocks as a `QuantWeight` (lossless; see gguf_quant.py); experts
        stored stacked ((E, rows, bytes): MXFP4's, which GPUs keep) as a `QuantExperts`."""
        import torch

        from kernels.qweight import QuantExperts
        from plugins.formats.gguf_quant import repack

        raw = torch.from_numpy(np.array(self._raw(name)))  # ([E,] rows, bytes per row)
        raw = self._unpermuted(name, raw).numpy()
        if (fix := self._fixes.get(name)) is not None and fix.rows is not None:
            raw = raw[..., fix.rows(self.config()), :]
        kind, shape = self.quant_format(name), self.shape(name)
        if raw.ndim == 3:
            return QuantExperts([repack(kind, r, shape[1:]) for r in raw])
        return repack(kind, raw, shape)

    def _raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (its expert's, of a stack), memory-mapped; interleaved
        ones (a matrix's rows of blocks: weights only) copied into the hub's row order, fused
        ones stacked, a Fix's columns moved back by whole blocks (copies). MXFP4's
        are ggml's `block_mxfp4` (an e8m0 scale byte, then 16 bytes: value j in the low nibble,
        j + 16 in the high one), which the CPU kernels keep as they are."""
        raws = [self.file.raw(n) for n in self._files(name)]
        if name in self._expert:
            raws = [raw[self._expert[name]] for raw in raws]
        if len(raws) == 1:
            raw = raws[0]
        elif name in self._fused:
            raw = np.concatenate(raws)
        else:
            raw = np.stack(raws, -2).reshape(*raws[0].shape[:-2], -1, raws[0].shape[-1])
        if (fix := self._fixes.get(name)) is None:
            return raw
        order = fix.block_order(self.config(), self.file.tensors[self._names[name]].ggml_type)
        if order is not None:  # a Fix's columns, moved by whole blocks
            raw = raw.reshape(raw.shape[0], len(order), -1)[:, order].reshape(raw.shape[0], -1)
        return raw

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
        from plugins.formats.gguf_tokenizer import build_tokenizer

        return build_tokenizer(self.file.metadata, self.path)

    def close(self) -> None:
        self.file.close()


def _detect(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


@hookimpl
def zoo_register_formats(registry):
    registry.add_format("gguf", detect=_detect, open=GGUFCheckpoint)
