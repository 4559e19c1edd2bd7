"""Where one batch-1 decode step goes: its time, its ops (torch.profiler), dynamo's guard check
timed on its own, and how fast this machine reads memory, to set the step against.

    python benchmarks/step_profile.py [MODEL] [--compile] [--steps 20] [--position 100]

The step is the model's own (`Model.step`: compiled with --compile), fed one token at one
position over and over, so each call reads every weight once. The guard check is timed by
calling the compiled graph's guard directly; torch.profiler's "TorchDynamo Cache Lookup" row
includes the profiler's own cost. The read rate is `tensor.sum()` over 1 GiB (CPU) or a
device-to-device copy (CUDA): the best a memory-bound step can stream.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.profiler import ProfilerActivity, profile

from core import load_model
from core.cli.bench import synchronize
from core.quantize import weight_formats


def timed_ms(fn, device: torch.device, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - t) * 1e3)
    return times


def read_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    x = torch.ones(nbytes // 4, device=device)
    if device.type == "cuda":
        y = torch.empty_like(x)
        ms = min(timed_ms(lambda: y.copy_(x), device, 6)[1:])
        return 2 * nbytes / ms / 1e6  # a copy reads and writes
    ms = min(timed_ms(x.sum, device, 6)[1:])
    return nbytes / ms / 1e6


def guard_check_ms(net: torch.nn.Module, f_locals: dict, repeat: int = 200) -> float | None:
    """ms dynamo spends checking the compiled step's guards per call (None: not compiled)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(type(net).forward.__code__)
    if not entries:
        return None
    check = entries[0].guard_manager.check
    if not check(f_locals):
        raise SystemExit("the compiled step's guards fail on these inputs: nothing to time")
    t = time.perf_counter()
    for _ in range(repeat):
        check(f_locals)
    return (time.perf_counter() - t) / repeat * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--device")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--position", type=int, default=100, help="the token's position in the cache")
    ap.add_argument("--rows", type=int, default=12, help="profiler rows to print")
    args = ap.parse_args()

    model = load_model(args.model, device=args.device, compile=args.compile)
    dev = model.device
    tokens = torch.tensor([1], device=dev)
    positions = torch.tensor([args.position], device=dev)
    end = args.position + 1
    weight_bytes = sum(nbytes for _, nbytes in weight_formats(model.net).values())

    with torch.inference_mode():
        step = lambda: model.step(tokens, positions, end)  # noqa: E731
        for _ in range(3):  # kernels, compilation, CUDA-graph capture
            step()
        times = timed_ms(step, dev, args.steps)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(args.steps):
                step()
            synchronize(dev)
        guard = None
        if args.compile:
            from core.decode_step import bucket

            ids = tokens[:, None]
            seq = model.net.kv_cache.max_seq_len
            f_locals = {"self": model.net, "input_ids": ids, "start_pos": positions,
                        "end": bucket(end, seq), "logits_at": None, "lengths": None}  # fmt: skip
            guard = guard_check_ms(model.net, f_locals)
    gbps = read_gbps(dev)

    best, median = min(times), statistics.median(times)
    how = "compiled" if args.compile else "eager"
    print(f"model    {model.path} ({dev}, {model.dtype}, {how})")
    print(f"step     min {best:.2f} ms, median {median:.2f} ms over {args.steps} steps")
    print(f"weights  {weight_bytes / 1e6:.0f} MB; memory reads at {gbps:.1f} GB/s here, so a step")
    floor = weight_bytes / gbps / 1e6
    print(f"         that reads every weight once takes at least {floor:.2f} ms")
    if guard is not None:
        print(f"guards   {guard:.3f} ms per call (dynamo's check, timed alone)")
    sort = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    print(f"\nper step (totals over {args.steps} steps / {args.steps}):")
    for e in sorted(prof.key_averages(), key=lambda e: -getattr(e, sort))[: args.rows]:
        ms = getattr(e, sort) / 1e3 / args.steps
        print(f"  {ms:8.3f} ms  {e.count / args.steps:6.1f} calls  {e.key[:70]}")


if __name__ == "__main__":
    main()
