"""The eager CPU decode step with the weights in 4 KiB pages (where torch's allocator puts
them) against the same weights in transparent huge pages (what load_model does on CPUs,
core/hugepages.py), in one process, alternating:

    python benchmarks/huge_pages.py [MODEL] [--rows 1] [--rounds 12] [--steps 15]

Two copies of the model are loaded; each round times `--steps` calls of each copy's step and
keeps their median, so both copies see the same moments of the machine (this host's read rate
moves by tens of percent from minute to minute). Prints the median over rounds of each, their
ratio, in how many rounds huge pages were faster, and the AnonHugePages the process holds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import core.api
from core import load_model
from core.hugepages import available


def step_ms(model, rows: int, steps: int) -> float:
    tokens, positions = torch.full((rows,), 5), torch.full((rows,), 60)
    model.step(tokens, positions, 61)  # the first call builds the fused step's view
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        model.step(tokens, positions, 61)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    if not available():
        sys.exit("no transparent huge pages on this machine: nothing to compare")
    moved = core.api.move_to_huge_pages
    core.api.move_to_huge_pages = lambda net: 0
    small = load_model(args.model, max_batch_size=args.rows, max_seq_len=256)
    core.api.move_to_huge_pages = moved
    huge = load_model(args.model, max_batch_size=args.rows, max_seq_len=256)
    times: dict[str, list[float]] = {"4 KiB pages": [], "huge pages": []}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, model in zip(times, (small, huge), strict=True):
                times[name].append(step_ms(model, args.rows, args.steps))
    for name, ts in times.items():
        print(f"{name:12s} step {statistics.median(ts):6.2f} ms  (rounds: "
              + " ".join(f"{t:.1f}" for t in ts) + ")")  # fmt: skip
    a, b = (statistics.median(ts) for ts in times.values())
    wins = sum(h < s for s, h in zip(*times.values(), strict=True))
    print(f"huge / 4 KiB: {b / a:.3f}; huge pages faster in {wins} of {args.rounds} rounds")
    rollup = Path("/proc/self/smaps_rollup").read_text().splitlines()
    print(next(line for line in rollup if line.startswith("AnonHugePages")))


if __name__ == "__main__":
    main()
