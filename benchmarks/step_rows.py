"""What a decode step of several rows costs against a step of one: the rows a server batches, or
the k + 1 positions speculative decoding verifies. A memory-bound step reads every weight once
whatever its rows, so a step of 4 rows should cost little more than a step of 1.

    python benchmarks/step_rows.py MODEL [--rows 1 2 4 8] [--repeat 15] [--position 256]

The step is the model's own (`Model.step`: on CPUs the fused C step), fed one token per row at
one position per row; the row counts are timed in turn, round after round, so that drifts in
the machine's speed hit all alike. Prints the median step time per row count and its ratio to
the one-row step, with the machine and the date; and the bytes each step reads (weights, and
the KV cache up to the position) per second against the machine's read rate, measured in the
same rounds as `zoo bench` measures it (a one-row fp32 product over a 1 GiB weight), so that a
slow minute of a shared machine slows both alike.
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
from core.cli.bench import cpu_stream_gbps
from core.cli.bench_llamacpp import machine
from core.quantize import weight_formats


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--position", type=int, default=256, help="each row's position in the cache")
    args = p.parse_args(argv)
    m = load_model(args.model, max_batch_size=max(args.rows), max_seq_len=args.position + 8)
    steps = {}
    for n in args.rows:
        g = torch.Generator().manual_seed(n)
        steps[n] = (torch.randint(10, m.config.vocab_size, (n,), generator=g),
                    torch.full((n,), args.position))  # fmt: skip
    times: dict[int, list[float]] = {n: [] for n in args.rows}
    probe: list[float] = []
    with torch.inference_mode():
        for tokens, pos in steps.values():  # untimed: whatever a first call builds
            m.step(tokens, pos, args.position + 1)
        for _ in range(args.repeat):
            if m.device.type == "cpu":
                probe.append(cpu_stream_gbps(repeat=2))
            for n, (tokens, pos) in steps.items():
                t = time.perf_counter()
                m.step(tokens, pos, args.position + 1)
                times[n].append((time.perf_counter() - t) * 1e3)
    fused = m.step.fused.why_not(max(args.rows)) if m.step.fused else "no fused step"
    one = statistics.median(times[args.rows[0]])
    weights = sum(nbytes for _, nbytes in weight_formats(m.net).values())
    kv = m.config.kv_bytes_per_token(m.net.kv_cache.dtype.itemsize) * (args.position + 1)
    print(f"{args.model}: decode step by rows, medians of {args.repeat}; {machine()}, "
          f"{datetime.date.today()}, torch {torch.__version__}, "
          f"Python {platform.python_version()}")  # fmt: skip
    print(
        f"  step: {'fused C step' if fused is None else 'modules (' + fused + ')'}; reads "
        f"{weights / 1e6:,.1f} MB of weights and {kv / 1e6:,.1f} MB of keys and values a row"
    )
    peak = statistics.median(probe) if probe else None
    if peak:
        print(f"  read rate: {peak:.1f} GB/s (one-row fp32 kernels.linear over 1 GiB, each round)")
    print(f"  {'rows':>4} {'ms':>8} {'x 1 row':>8} {'GB/s':>7}" + (" of read rate" if peak else ""))
    for n in args.rows:
        ms = statistics.median(times[n])
        gbps = (weights + n * kv) / ms / 1e6
        print(
            f"  {n:>4} {ms:>8.2f} {ms / one:>8.2f} {gbps:>7.1f}"
            + (f" {gbps / peak:>12.0%}" if peak else "")
        )


if __name__ == "__main__":
    main()
