"""What compiling the decode step costs before the first token, and what it saves after:
load a model, time a first reply (the compile happens there) and a second one, eager or
compiled. Run it once with an empty inductor cache (`TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)`)
and once with a warm one: each process pays one of the two.

    python benchmarks/compile_warmup.py [MODEL] [--compile] [--first 16] [--then 128]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core import load_model

PROMPT = "Write a short story about a cat."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--first", type=int, default=16, help="tokens of the first reply")
    ap.add_argument("--then", type=int, default=128, help="tokens of the second reply")
    args = ap.parse_args()

    t = time.perf_counter()
    m = load_model(args.model, compile=args.compile)
    loaded = time.perf_counter()
    m.generate(PROMPT, max_new_tokens=args.first, temperature=0.0, ignore_eos=True)
    first = time.perf_counter()
    r = m.generate(PROMPT, max_new_tokens=args.then, temperature=0.0, ignore_eos=True)
    then = time.perf_counter()
    how = "compiled" if args.compile else "eager"
    print(
        f"{how}: load {loaded - t:.1f} s; first reply ({args.first} tokens) {first - loaded:.1f} s;"
        f" second ({args.then} tokens) {then - first:.2f} s,"
        f" decode {r.timings['decode_tokens_per_s']:.1f} tokens/s"
    )


if __name__ == "__main__":
    main()
