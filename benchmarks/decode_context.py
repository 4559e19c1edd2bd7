"""What the decode-step-against-context benchmarks share (linear_decode.py, mamba_decode.py):
their flags, the timing of one row's decode step at a position, and the markdown table with
the machine, date and command."""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time

import torch


def parser(doc: str) -> argparse.ArgumentParser:
    """The common flags: --contexts, --repeat, --dtype, --cpu-time."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096, 8192])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="one thread, timed by its CPU time (time.thread_time): the work of a step, not "
        "the time other processes on a shared machine take from it",
    )
    return ap


def clock_of(args: argparse.Namespace):
    """The clock the flags ask for (one thread's CPU time under --cpu-time, else wall time)."""
    if args.cpu_time:
        torch.set_num_threads(1)
        return time.thread_time
    return time.perf_counter


def step_ms(runs: dict, pos: int, repeat: int, clock=time.perf_counter) -> list[float]:
    """Per run (name -> (model, fused)), the fastest of `repeat` decode steps of one row at
    position `pos`, in ms: `fused` through the model's decode step (the fused C blocks on
    CPUs, where they take the model), else the modules (`Model.forward`). The runs alternate
    step by step so that other load on the machine slows all alike."""
    tok, pos_t = torch.tensor([[7]]), torch.tensor([pos])
    best = [float("inf")] * len(runs)
    with torch.inference_mode():
        for _ in range(repeat):
            for i, (model, fused) in enumerate(runs.values()):
                t0 = clock()
                if fused:
                    model.step(tok[0], pos_t, pos + 1)
                else:
                    model.forward(tok, pos)
                best[i] = min(best[i], clock() - t0)
    return [b * 1e3 for b in best]


def report(runs: dict, args: argparse.Namespace, clock) -> None:
    """Print the command, the machine, each distinct model's cache, and the table."""
    print(f"`{' '.join(['python', *sys.argv])}`")
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, {args.dtype}, {datetime.date.today()}"
        + (", CPU time of one thread" if args.cpu_time else ", wall time")
    )
    seen: dict[int, str] = {}
    for name, (m, _) in runs.items():
        seen.setdefault(id(m), f"{name.split(' (')[0]} {m.net.kv_cache.nbytes / 2**20:.1f} MiB")
    seq = max(args.contexts) + 1
    print(f"cache (KV + state) for {seq} tokens: " + ", ".join(seen.values()))
    step_ms(runs, max(args.contexts), 5, clock)  # warm-up: first calls build what a step needs
    print()
    print("| context | " + " | ".join(f"{n} (ms/step)" for n in runs) + " |")
    print("|---:|" + "---:|" * len(runs))
    for ctx in args.contexts:
        row = [f"{ms:.2f}" for ms in step_ms(runs, ctx, args.repeat, clock)]
        print(f"| {ctx} | " + " | ".join(row) + " |", flush=True)
