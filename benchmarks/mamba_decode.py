"""Decode step time against context length: Mamba2 layers beside full attention, on three
random-weight Granite-4.0-H-like models identical but for which layers are Mamba2.

A full-attention layer's decode step at position p reads p + 1 cached positions; a Mamba2
layer reads its fixed-size state (the conv's last K - 1 inputs + a head_dim x state matrix per
head), whatever p is. So the all-Mamba2 model's step stays flat as the context grows, the
all-attention model's grows, and the hybrid (9 Mamba2 : 1 attention, as Granite 4.0-H) grows
at a tenth of that slope. Each model runs both ways: the eager modules (`Model.forward`) and the
decode step a generation takes (the fused C blocks on CPUs: kernels/cpu/mamba.c). Each position
is timed directly (the work does not depend on the cache content). Prints a markdown table
with the machine, date and command.

    .venv/bin/python benchmarks/mamba_decode.py [--contexts 128 1024 4096 8192] [--repeat 15]
        [--cpu-time]
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

from benchmarks.decode_context import clock_of, parser, report
from core.cli.bench import random_model_of
from core.config_kinds import Mamba2Spec
from plugins.llama3 import LlamaConfig

LAYERS = 10
# Granite 4.0-H's Mamba2 heads (64 dims, state 128, one group of B / C, conv of 4, expand 2)
# and its attention heads (128 dims, one kv head) at a small width, with a small vocabulary so that
# the layers are most of a step; a dense MLP (Granite 4.0-H Micro's shared MLP)
BASE = dict(
    model_type="llama",
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=128,
    max_position_embeddings=65536,
    rms_norm_eps=1e-5,
)
MAMBA = Mamba2Spec(num_heads=16, head_dim=64, state_size=128, n_groups=1, conv_kernel=4,
                   chunk_size=256, norm_eps=1e-5)  # fmt: skip
KINDS = {
    "mamba2": [True] * LAYERS,
    "hybrid 9:1": [i != LAYERS // 2 for i in range(LAYERS)],
    "attention": [False] * LAYERS,
}


def model(mamba_layers: list[bool], args, seq: int):
    cfg = LlamaConfig.from_dict(BASE).to_runtime()
    kinds = tuple(MAMBA if m else cfg.attention for m in mamba_layers)
    cfg = dataclasses.replace(cfg, attention_layers=kinds)
    return random_model_of(cfg, device="cpu", dtype=args.dtype, max_seq_len=seq,
                           max_batch_size=1)  # fmt: skip


def main() -> None:
    args = parser(__doc__).parse_args()
    clock = clock_of(args)
    seq = max(args.contexts) + 1
    runs = {}
    for name, layers in KINDS.items():
        m = model(layers, args, seq)
        why = m.step.fused.why_not() if m.step.fused is not None else "not on the CPU"
        assert why is None, f"{name}: the fused step does not take it ({why})"
        runs[f"{name} (eager)"] = (m, False)
        runs[f"{name} (fused C)"] = (m, True)
    report(runs, args, clock)


if __name__ == "__main__":
    main()
