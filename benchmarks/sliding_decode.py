"""Decode step time against context length: a sliding-window model beside a full-attention one.

Two random-weight Mistral-like models of one small shape (sized for a 2-core CPU: attention's
share of a step must be visible), identical but for `sliding_window`. A decode step at
position p reads p + 1 cached positions in every full layer, but at most `window` in a sliding
layer (its ring buffer), so past the window the sliding model's step time stays flat while the
full model's keeps growing. The cache content does not change the work, so each position is
timed directly (no prefill). Prints a markdown table with the machine, date and command.

    .venv/bin/python benchmarks/sliding_decode.py [--window 512] [--contexts 128 512 2048 8192]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

import torch

from core.cli.bench import random_model

# Mistral 7B's head_dim (128) and SwiGLU ratio (3.5x) at 1/8 of its width, with more kv heads
# per query head (1:1) and a smaller vocabulary so that the KV cache is a visible share of
# what a step reads
SHAPE = dict(
    model_type="mistral",
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1792,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=128,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
    rms_norm_eps=1e-5,
)


def step_ms(models: dict, pos: int, repeat: int) -> list[float]:
    """Per model, the fastest of `repeat` decode steps (1 row, eager) at position `pos`, in
    ms. The models alternate step by step and the minimum is kept, so that other load on the
    machine (a busy shared CPU) slows both alike and least disturbs the figure."""
    tok = torch.tensor([[7]])
    best = [float("inf")] * len(models)
    with torch.inference_mode():
        for _ in range(repeat):
            for i, model in enumerate(models.values()):
                t0 = time.perf_counter()
                model.forward(tok, pos)
                best[i] = min(best[i], time.perf_counter() - t0)
    return [b * 1e3 for b in best]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048, 8192])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    seq = max(args.contexts) + 1
    models = {
        "full": random_model(
            SHAPE, device="cpu", dtype=args.dtype, max_seq_len=seq, max_batch_size=1
        ),
        f"window {args.window}": random_model(
            dict(SHAPE, sliding_window=args.window),
            device="cpu",
            dtype=args.dtype,
            max_seq_len=seq,
            max_batch_size=1,
        ),
    }
    print(f"`{' '.join(['python', *sys.argv])}`")
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, {args.dtype}, {datetime.date.today()}"
    )
    kv = {n: m.net.kv_cache.nbytes for n, m in models.items()}
    print(
        f"KV cache for {seq} tokens: "
        + ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in kv.items())
    )
    print()
    print("| context | " + " | ".join(f"{n} (ms/step)" for n in models) + " |")
    print("|---:|" + "---:|" * len(models))
    for ctx in args.contexts:
        row = [f"{ms:.2f}" for ms in step_ms(models, ctx, args.repeat)]
        print(f"| {ctx} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
