"""Decode step time against context length: gated-DeltaNet (linear attention) layers beside
full attention, on three random-weight Qwen3.5-like models identical but for `layer_types`.

A full-attention layer's decode step at position p reads p + 1 cached positions; a gated
DeltaNet layer reads its fixed-size state (conv inputs + a Dk x Dv matrix per value head),
whatever p is. So the all-linear model's step stays flat as the context grows, the
all-attention model's grows, and the hybrid (3 linear : 1 attention, as Qwen3-Next / Qwen3.5)
grows at a quarter of that slope. Each position is timed directly (the work does not depend
on the cache content). Prints a markdown table with the machine, date and command.

    .venv/bin/python benchmarks/linear_decode.py [--contexts 128 1024 4096 8192] [--repeat 15]
        [--cpu-time]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

from benchmarks.decode_context import clock_of, parser, report
from core.cli.bench import random_model

LAYERS = 8
# Qwen3.5's head sizes (attention head_dim 256, linear heads 128 x 128) at a small width, with a
# small vocabulary so that the layers are most of a step
SHAPE = dict(
    model_type="qwen3_5_text",
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=65536,
    rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
)
KINDS = {
    "linear": ["linear_attention"] * LAYERS,
    "hybrid 3:1": (["linear_attention"] * 3 + ["full_attention"]) * (LAYERS // 4),
    "attention": ["full_attention"] * LAYERS,
}


def main() -> None:
    args = parser(__doc__).parse_args()
    clock = clock_of(args)
    seq = max(args.contexts) + 1
    runs = {
        name: (
            random_model(
                dict(SHAPE, layer_types=kinds),
                device="cpu",
                dtype=args.dtype,
                max_seq_len=seq,
                max_batch_size=1,
            ),
            False,  # the modules, as measured before the fused step took DeltaNet layers
        )
        for name, kinds in KINDS.items()
    }
    report(runs, args, clock)


if __name__ == "__main__":
    main()
