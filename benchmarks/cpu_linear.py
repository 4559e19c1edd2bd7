"""F.linear against kernels.cpu.linear (output rows split over the threads) on the CPU, for the
weight shapes of a model, at a few row counts: time and the bandwidth it implies.

Each shape is stacked `--layers` times so the weights stream from memory, as in a decode step.
The split is timed directly (`kernels.cpu.split.split_linear`), whatever `split_pays` chose for
`kernels.cpu.linear`.

    python benchmarks/cpu_linear.py [--shape smollm2] [--rows 1,4,16,64] [--layers 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# the repository root first: this folder's kernels.py would shadow the `kernels` package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from core.catalog import named_models
from kernels.cpu import split


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
    )
    d = cfg.get("head_dim") or h // heads
    return {
        "qkv": ((heads + 2 * kv) * d, h),
        "o": (h, heads * d),
        "gate_up": (2 * i, h),
        "down": (h, i),
        "lm_head": (cfg["vocab_size"], h),
    }


def best_ms(fn, repeat: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2", help="a registry.yaml name with a shape")
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--layers", type=int, default=30, help="copies of each weight (not lm_head)")
    args = ap.parse_args()
    cfg = named_models()[args.shape]["shape"]
    blocks = torch.get_num_threads()
    print(f"{args.shape}, fp32, {blocks} threads; ms for all copies, GB/s")
    print(f"kernels.cpu.split_pays(float32) on this machine: {split.split_pays(torch.float32)}")
    print(f"{'weight':>8} {'rows':>5} {'F.linear':>10} {'GB/s':>6} {'split':>10} {'GB/s':>6}")
    for name, (out_f, in_f) in shapes(cfg).items():
        n = 1 if name == "lm_head" else args.layers
        ws = [torch.randn(out_f, in_f) for _ in range(n)]
        gb = n * out_f * in_f * 4 / 1e9
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_f)
            plain = best_ms(lambda: [F.linear(x, w) for w in ws])  # noqa: B023
            split_ms = best_ms(lambda: [split.split_linear(x, w, blocks) for w in ws])  # noqa: B023
            print(
                f"{name:>8} {rows:>5} {plain:>10.2f} {gb / plain * 1e3:>6.1f} "
                f"{split_ms:>10.2f} {gb / split_ms * 1e3:>6.1f}"
            )


if __name__ == "__main__":
    main()
