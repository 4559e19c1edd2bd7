"""Peak memory while loading a checkpoint larger than 1 GB: does the loader ever hold two full
copies of the weights? Writes a random Llama-shaped safetensors checkpoint, loads it with
`load_model` in a fresh process, and prints peak RSS next to the checkpoint's size.

    python benchmarks/load_memory.py [--hidden 2048 --layers 12] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """
import json, resource, sys, time
from core import load_model
t = time.perf_counter()
m = load_model(sys.argv[1], max_seq_len=64)
elapsed = time.perf_counter() - t
status = dict(l.split(":", 1) for l in open("/proc/self/status"))
kib = lambda k: int(status[k].split()[0]) * 1024
print(json.dumps({
    "load_s": elapsed,
    "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "rss_anon_after": kib("RssAnon"),
    "rss_file_after": kib("RssFile"),
    "param_bytes": sum(p.numel() * p.element_size() for p in m.net.parameters()),
}))
"""

BASELINE = """
import json, resource
import torch, core.api, core.model, plugins.formats.safetensors  # what loading imports, no weights
print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def write_checkpoint(root: Path, hidden: int, layers: int, vocab: int) -> int:
    import torch
    from safetensors.torch import save_file

    inter = hidden * 4
    cfg = dict(
        model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=4,
        max_position_embeddings=2048, torch_dtype="float32", tie_word_embeddings=False,
    )  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    kv = 4 * 64
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    # shards of ~500 MB, as hub repos ship them
    shard, size, index, n = {}, 0, {}, 0
    total = 0
    for name, shape in shapes.items():
        shard[name] = torch.randn(shape) * 0.02
        size += shard[name].nbytes
        if size > 500e6 or name == list(shapes)[-1]:
            fname = f"model-{n:05d}.safetensors"
            save_file(shard, root / fname, metadata={"format": "pt"})
            index |= {k: fname for k in shard}
            total += size
            shard, size, n = {}, 0, n + 1
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--keep", type=Path, help="write the checkpoint here and keep it")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp) / "ckpt"
        size = write_checkpoint(root, args.hidden, args.layers, args.vocab)
        base = json.loads(subprocess.check_output([sys.executable, "-c", BASELINE]))
        got = json.loads(subprocess.check_output([sys.executable, "-c", PROBE, str(root)]))
    gb = 1e9
    shape = f"{args.layers} layers, hidden {args.hidden}"
    peak, base_rss = got["peak_rss"], base["peak_rss"]
    anon, filed = got["rss_anon_after"] / gb, got["rss_file_after"] / gb
    print(f"checkpoint      {size / gb:.2f} GB fp32 safetensors ({shape})")
    print(f"baseline RSS    {base_rss / gb:.2f} GB (python, torch, zoo imported; no weights)")
    print(f"peak RSS        {peak / gb:.2f} GB while loading ({got['load_s']:.1f} s)")
    print(f"peak - baseline {(peak - base_rss) / size:.2f} x the checkpoint size")
    print(f"after load      anon {anon:.2f} GB, file-backed {filed:.2f} GB")


if __name__ == "__main__":
    main()
