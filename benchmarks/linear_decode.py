"""Decode step time against context length: gated-DeltaNet (linear attention) or Mamba2
layers beside full attention, on three random-weight models identical but for `layer_types`
(`--family qwen3.5`: Qwen3.5-like; `--family granite`: Granite 4.0-H-like, Mamba2 + NoPE
attention; `--family nemotron`: two Nemotron-H-like models, dense and MoE, of one-mixer layers).

A full-attention layer's decode step at position p reads p + 1 cached positions; a gated
DeltaNet layer reads its fixed-size state (conv inputs + a Dk x Dv matrix per value head), a
Mamba2 layer its own (conv inputs + a head_dim x state matrix per head), whatever p is. So
the all-linear model's step stays flat as the context grows, the all-attention model's grows,
and the hybrid (3 linear : 1 attention, as Qwen3-Next / Qwen3.5) grows at a quarter of that
slope. Each position is timed directly (the work does not depend
on the cache content). Prints a markdown table with the machine, date and command. `--fused`
times each model twice: through the modules (`Model.forward`, eager) and through the decode
step a generation takes (the fused C blocks on CPUs: kernels/cpu/delta.c, mamba.c).

    .venv/bin/python benchmarks/linear_decode.py [--contexts 128 1024 4096 8192] [--repeat 15]
        [--cpu-time] [--family qwen3.5|granite|lfm2|nemotron] [--fused]
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
# Granite 4.0-H's Mamba2 sizes (heads of 64, a state of 128) at the same width, the shared MLP
# alone (as the Micro), NoPE attention with heads of 128
GRANITE = dict(
    model_type="granitemoehybrid",
    vocab_size=8192,
    hidden_size=512,
    shared_intermediate_size=1536,
    num_local_experts=0,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    mamba_n_heads=16,
    mamba_d_head=64,
    mamba_d_state=128,
    mamba_n_groups=1,
    mamba_d_conv=4,
    mamba_expand=2,
    max_position_embeddings=65536,
    rms_norm_eps=1e-5,
)
GRANITE_KINDS = {
    "mamba2": ["mamba"] * LAYERS,
    "hybrid 3:1": (["mamba"] * 3 + ["attention"]) * (LAYERS // 4),
    "attention": ["attention"] * LAYERS,
}
# LFM2's gated short convs (3 taps) beside GQA attention with q/k norms, at the same width
LFM2 = dict(
    model_type="lfm2",
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    block_auto_adjust_ff_dim=False,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    conv_L_cache=3,
    max_position_embeddings=65536,
    norm_eps=1e-5,
)
LFM2_KINDS = {
    "short conv": ["conv"] * LAYERS,
    "hybrid 3:1": (["conv"] * 3 + ["full_attention"]) * (LAYERS // 4),
    "attention": ["full_attention"] * LAYERS,
}
# Nemotron-H's Mamba2 sizes (heads of 64, a state of 128, 8 groups), NoPE attention, relu2
# MLPs (Nano 2-like) or MoE layers of relu2 experts + a shared one, sigmoid-routed (Nemotron 3
# Nano-like), each layer one mixer
NEMOTRON = dict(
    model_type="nemotron_h",
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    mamba_num_heads=16,
    mamba_head_dim=64,
    ssm_state_size=128,
    n_groups=8,
    conv_kernel=4,
    chunk_size=128,
    n_routed_experts=32,
    num_experts_per_tok=6,
    moe_intermediate_size=256,
    moe_shared_expert_intermediate_size=512,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=65536,
    layer_norm_epsilon=1e-5,
)
NEMOTRON_KINDS = {
    "dense M-M*-": ["mamba", "mlp", "mamba", "mlp", "mamba", "attention", "mamba", "mlp"],
    "MoE MEM*E": ["mamba", "moe", "mamba", "moe", "mamba", "attention", "mamba", "moe"],
}
FAMILIES = {
    "qwen3.5": (SHAPE, KINDS),
    "granite": (GRANITE, GRANITE_KINDS),
    "lfm2": (LFM2, LFM2_KINDS),
    "nemotron": (NEMOTRON, NEMOTRON_KINDS),
}
# the config key that lists a model's layer kinds, where it is not `layer_types`
KINDS_KEY = {"nemotron_h": "layers_block_type"}


def step_ms(runs: dict, pos: int, repeat: int, clock=time.perf_counter) -> list[float]:
    """Per run (name -> (model, fused)), the fastest of `repeat` decode steps of one row at
    position `pos`, in ms: through the model's decode step where `fused` (the fused C blocks
    on CPUs), else the eager modules. The runs alternate step by step so that other load on
    the machine slows all alike."""
    tok, at = torch.tensor([[7]]), torch.tensor([pos])
    best = [float("inf")] * len(runs)
    with torch.inference_mode():
        for _ in range(repeat):
            for i, (model, fused) in enumerate(runs.values()):
                t0 = clock()
                if fused:
                    model.step(tok[0], at, pos + 1)
                else:
                    model.forward(tok, pos)
                best[i] = min(best[i], clock() - t0)
    return [b * 1e3 for b in best]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096, 8192])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--family", choices=list(FAMILIES), default="qwen3.5")
    ap.add_argument("--fused", action="store_true", help="also time the fused C decode step")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="one thread, timed by its CPU time (time.thread_time): the work of a step, not "
        "the time other processes on a shared machine take from it",
    )
    args = ap.parse_args()
    clock = time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = time.thread_time
    seq = max(args.contexts) + 1
    shape, layer_kinds = FAMILIES[args.family]
    key = KINDS_KEY.get(shape["model_type"], "layer_types")
    models = {
        name: random_model(
            dict(shape, **{key: kinds}),
            device="cpu",
            dtype=args.dtype,
            max_seq_len=seq,
            max_batch_size=1,
        )
        for name, kinds in layer_kinds.items()
    }
    runs = {name: (m, False) for name, m in models.items()}
    if args.fused:
        runs = {}
        for name, m in models.items():
            why = m.step.fused.why_not() if m.step.fused is not None else "not on the CPU"
            assert why is None, f"{name}: the fused step does not take it ({why})"
            runs[f"{name} (eager)"], runs[f"{name} (fused C)"] = (m, False), (m, True)
    print(f"`{' '.join(['python', *sys.argv])}`")
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, {args.dtype}, {datetime.date.today()}"
        + (", CPU time of one thread" if args.cpu_time else ", wall time")
    )
    cache = {n: m.net.kv_cache.nbytes for n, m in models.items()}
    print(
        f"cache (KV + state) for {seq} tokens: "
        + ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in cache.items())
    )
    step_ms(runs, max(args.contexts), 5, clock)  # warm-up: first calls build what a step needs
    print()
    print("| context | " + " | ".join(f"{n} (ms/step)" for n in runs) + " |")
    print("|---:|" + "---:|" * len(runs))
    for ctx in args.contexts:
        row = [f"{ms:.2f}" for ms in step_ms(runs, ctx, args.repeat, clock)]
        print(f"| {ctx} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
