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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

from benchmarks.decode_context import clock_of, parser, report
from core.cli.bench import random_model

LAYERS = 10
# Granite 4.0-H's heads (Mamba2: 64 dims, a state of 128, one group of B / C, a conv of 4,
# expand 2; NoPE attention of 128 dims per head) at a small width, with a small vocabulary so
# that the layers are most of a step; no experts (Granite 4.0-H Micro: the shared MLP alone)
SHAPE = dict(
    model_type="granitemoehybrid",
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    shared_intermediate_size=1536,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=1,
    num_local_experts=0,
    num_experts_per_tok=0,
    mamba_n_heads=16,
    mamba_d_head=64,
    mamba_d_state=128,
    mamba_n_groups=1,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=256,
    position_embedding_type="nope",
    max_position_embeddings=65536,
    rms_norm_eps=1e-5,
    residual_multiplier=0.5,  # (Granite's multipliers cost nothing measurable; one in C)
)
KINDS = {
    "mamba2": ["mamba"] * LAYERS,
    "hybrid 9:1": ["attention" if i == LAYERS // 2 else "mamba" for i in range(LAYERS)],
    "attention": ["attention"] * LAYERS,
}


def main() -> None:
    args = parser(__doc__).parse_args()
    clock = clock_of(args)
    seq = max(args.contexts) + 1
    runs = {}
    for name, kinds in KINDS.items():
        m = random_model(dict(SHAPE, layer_types=kinds), device="cpu", dtype=args.dtype,
                         max_seq_len=seq, max_batch_size=1)  # fmt: skip
        why = m.step.fused.why_not() if m.step.fused is not None else "not on the CPU"
        assert why is None, f"{name}: the fused step does not take it ({why})"
        runs[f"{name} (eager)"] = (m, False)
        runs[f"{name} (fused C)"] = (m, True)
    report(runs, args, clock)


if __name__ == "__main__":
    main()
