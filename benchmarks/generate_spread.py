"""How much decode speed moves between runs in one process: N greedy replies of 64 tokens to
the same prompt, each one's decode tokens/s, and their median and spread.

    python benchmarks/generate_spread.py [MODEL] [--runs 8] [--tokens 64] [--compile]

Run it with `OMP_WAIT_POLICY=active|passive` to see what the threads' wait policy does; run it
on a quiet machine (other processes move it most).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    m = load_model(args.model, compile=args.compile)
    prompt = m.encode_prompt("Tell me a story about a dragon who learns to fly over the mountains.")
    rates = []
    for _ in range(args.runs):
        r = m.generate(prompt, max_new_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        rates.append(r.timings["decode_tokens_per_s"])
    print("decode tokens/s per run:", " ".join(f"{x:.0f}" for x in rates))
    print(f"median {statistics.median(rates):.1f}, min {min(rates):.1f}, max {max(rates):.1f}")


if __name__ == "__main__":
    main()
