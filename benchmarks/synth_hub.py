"""A hub-style checkpoint of a registry.yaml shape with random weights, for llama.cpp's own
converter to turn into the GGUF file a user downloads (benchmarks/gguf_synth.py's path for
the architectures whose GGUF metadata it does not write itself: Qwen3.5's hybrids, gpt-oss,
LFM2).

The tensors are the ones transformers' model of that config holds (built on the meta device:
nothing is allocated), written shard by shard in bf16: normal weights (std 0.02), norms 1,
and the gated DeltaNet's decay parameters as the released checkpoints have them (A_log
log(1..16), dt_bias 1). gpt-oss's experts are written as its released checkpoints store them,
MXFP4 `_blocks` + `_scales` (e8m0 exponents 2^-8 .. 2^-6: weights of about the others' size),
so the converter copies them into the file as MXFP4. The tokenizer is the embedded SmolLM2's
(49,152 tokens, byte-level BPE), which the converter pads to the shape's vocabulary size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

STD = 0.02
SHARD_BYTES = 2 << 30
# a shape's model_type -> (the text model's model_type, its architecture for the converter)
TEXT_MODELS = {
    "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
    "qwen3_5": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
    "lfm2": ("lfm2", "Lfm2ForCausalLM"),
}


def text_config(shape: dict, layers: int | None) -> dict:
    """config.json of the shape's text model, sliced to its first `layers` layers."""
    kind, arch = TEXT_MODELS[shape["model_type"]]
    cfg = dict(shape.get("text_config", shape), model_type=kind, architectures=[arch])
    tied = shape.get("tie_word_embeddings", shape.get("tie_embedding", False))  # LFM2's legacy key
    cfg.setdefault("tie_word_embeddings", tied)
    if layers:
        cfg["num_hidden_layers"] = layers
        for key in ("layer_types", "mlp_only_layers"):
            if isinstance(cfg.get(key), list):
                cfg[key] = cfg[key][:layers]
    if "full_attn_idxs" in cfg and "layer_types" not in cfg:  # LFM2's legacy pattern: the
        n = cfg["num_hidden_layers"]  # converter reads layer_types
        cfg["layer_types"] = ["full_attention" if i in cfg["full_attn_idxs"] else "conv"
                              for i in range(n)]  # fmt: skip
    cfg["mtp_num_hidden_layers"] = 0  # the converter would look for MTP tensors
    cfg["torch_dtype"] = "bfloat16"
    if kind == "gpt_oss":
        cfg["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
        }
    return cfg


def planned(cfg: dict) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every tensor transformers' model of cfg holds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    args = {k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config")}
    conf = AutoConfig.for_model(args.pop("model_type"), **args)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _mxfp4(rng: torch.Generator, e: int, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """Random MXFP4 (E, rows, cols / 32, 16) code bytes and (E, rows, cols / 32) e8m0 scales."""
    blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=rng, dtype=torch.uint8)
    scales = torch.randint(119, 122, (e, rows, cols // 32), generator=rng, dtype=torch.uint8)
    return blocks, scales


def _values(name: str, shape: tuple[int, ...], rng: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.log(torch.empty(shape).uniform_(1, 16, generator=rng)).bfloat16()
    if name.endswith("dt_bias") or ("norm" in name and len(shape) == 1):
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=rng) * STD).bfloat16()


def tensors(cfg: dict, seed: int):
    """(name, tensor) of the checkpoint, one at a time, in the model's order."""
    rng = torch.Generator().manual_seed(seed)
    mxfp4 = "quantization_config" in cfg
    for name, shape in planned(cfg).items():
        if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue  # the embedding's: a tied checkpoint stores it once
        if mxfp4 and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, cols, rows = shape  # transformers holds them (E, in, out)
            blocks, scales = _mxfp4(rng, e, rows, cols)
            yield f"{name}_blocks", blocks
            yield f"{name}_scales", scales
        else:
            yield name, _values(name, shape, rng)


def write_folder(shape: dict, folder: Path, layers: int | None, seed: int = 0) -> Path:
    """The checkpoint folder (config.json, safetensors shards and their index, tokenizer)."""
    from transformers import AutoTokenizer

    from benchmarks.gguf_synth import smollm2_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = text_config(shape, layers)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    gguf_file = smollm2_file()
    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    tok.save_pretrained(folder)
    index, shard, size, n = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            n += 1
            save_file(shard, folder / f"model-{n:05d}.safetensors", metadata={"format": "pt"})
            print(f"  shard {n}: {size / 1e9:.1f} GB", flush=True)
        shard, size = {}, 0

    for name, t in tensors(cfg, seed):
        if size + t.nbytes > SHARD_BYTES:
            flush()
        shard[name] = t.contiguous()
        index[name] = n + 1
        size += t.nbytes
    flush()
    weight_map = {name: f"model-{i:05d}.safetensors" for name, i in index.items()}
    total = sum(f.stat().st_size for f in folder.glob("model-*.safetensors"))
    meta = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(meta, indent=1))
    print(f"{folder}: {total / 1e9:.1f} GB in {n} shards, {math.ceil(len(index))} tensors")
    return folder
