"""What verifying drafted tokens costs on CPUs: T consecutive tokens of one sequence through the
fused C step in one call (a chain: `Model.step` with the row named T times) against the modules'
forward of the same T tokens (`net(ids (1, T), position)`), and against T different rows at one
position (the same products without a chain's one extra meeting of the threads per block).

    python benchmarks/verify_cost.py [MODEL] [--tokens 1 2 4 6 8 16] [--repeat 30]
                                     [--position 256] [--quantize int8] [--threads 1]

Every (kind, T) is timed once per round, round after round, so that drifts in a shared
machine's speed hit all alike; prints the median and the 10th percentile per (kind, T) and
their ratios to the fused step of one token, with the machine and the date.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

import torch

from core import load_model
from core.cli.bench_llamacpp import machine

KINDS = ("chain", "rows", "modules")


def calls(m, n: int, position: int) -> dict:
    """The three ways of feeding n tokens, as argument-less calls."""
    g = torch.Generator().manual_seed(n)
    tokens = torch.randint(10, m.config.vocab_size, (n,), generator=g)
    at = torch.arange(n) + position
    end = position + n
    chain, same = torch.zeros(n, dtype=torch.long), torch.full((n,), position)
    return {
        "chain": lambda: m.step(tokens, at, end, rows=chain),
        "rows": lambda: m.step(tokens, same, position + 1, rows=torch.arange(n)),
        "modules": lambda: m.net(tokens[None], position)[:, -1],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="smollm2")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16])
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--position", type=int, default=256, help="the first token's position")
    p.add_argument("--quantize", default=None, help="int8 / int4: quantized at load")
    p.add_argument("--threads", type=int, default=None, help="torch's (and the C step's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    top = max(args.tokens)
    m = load_model(args.model, max_batch_size=top, max_seq_len=args.position + top + 1,
                   quantize=args.quantize)  # fmt: skip
    if not m.step.takes_chain(top):
        sys.exit(f"{args.model}: the step takes no chain of {top} tokens")
    fns = {n: calls(m, n, args.position) for n in args.tokens}
    times = {(k, n): [] for n in args.tokens for k in KINDS}
    with torch.inference_mode():
        for per in fns.values():  # untimed: whatever a first call builds
            for fn in per.values():
                fn()
        for _ in range(args.repeat):
            for n, per in fns.items():
                for k, fn in per.items():
                    t = time.perf_counter()
                    fn()
                    times[k, n].append((time.perf_counter() - t) * 1e3)
    q = f" ({args.quantize} at load)" if args.quantize else ""
    print(f"{args.model}{q}: T tokens at positions {args.position}.., {args.repeat} rounds, "
          f"{torch.get_num_threads()} threads; "
          f"{machine()}, {datetime.date.today()}, torch {torch.__version__}, "
          f"Python {platform.python_version()}")  # fmt: skip
    # the median, and the 10th percentile: the calls a busy machine slowed least
    for name, stat in (("median", statistics.median), ("10th percentile", tenth)):
        ms = {key: stat(v) for key, v in times.items()}
        one = ms["chain", args.tokens[0]]
        print(f"  {name} (ms, and x the fused step of {args.tokens[0]} token)")
        print(f"  {'T':>3} {'chain (fused)':>16} {'T rows (fused)':>16} {'modules':>16}")
        for n in args.tokens:
            cells = [f"{ms[k, n]:8.2f} {ms[k, n] / one:5.2f}x" for k in KINDS]
            print(f"  {n:>3} " + " ".join(f"{c:>16}" for c in cells))


def tenth(v: list[float]) -> float:
    return sorted(v)[len(v) // 10]


if __name__ == "__main__":
    main()
