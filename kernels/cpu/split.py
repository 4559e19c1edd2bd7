"""CPU fast paths: the same torch math, arranged for how the BLAS parallelizes on few cores.

`linear`: for a few rows (decode: one token per sequence), some BLAS builds run y = x @ W.T on
one thread: MKL on the AMD EPYC CI machines did, at ~14 GB/s although two threads read
~36 GB/s. Viewing W's output rows as `threads` contiguous blocks and multiplying them as one
batched matmul gives each thread its own block: 1.3-1.9x at one row, 2.1-3.3x at four there.
On Intel Xeons MKL already spreads a one-row product over the threads, and the split is 2-3x
*slower* (`benchmarks/cpu_linear.py`). So which path runs is measured, not assumed: once per
process and (dtype, threads), `split_pays` times both on a one-row probe and keeps the split
only where it is clearly faster; the verdict holds for every row count up to MAX_ROWS (it
answers whether the BLAS leaves threads idle; at more rows the timings are too close to call
the same way in every process, and a path that changed between runs would change rounding).
Results equal F.linear's to float rounding (the same dot products, summed in another order).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# Eager, the split wins up to 8 rows and breaks even at 16 on the EPYC; in a compiled step
# inductor turns it into its own loops, which beat MKL at 16 rows there too (batch-16 decode
# 91 -> 76 ms/step).
MAX_ROWS = 16
# The probe: a one-row product with a 4096 x 2048 weight (32 MiB in fp32: past a core's
# caches, ~2 ms a call; with an 8 MiB weight the EPYC's verdict sat at the margin, 0.77x, where
# a busy moment tips it). The split must beat F.linear by PROBE_MARGIN, so timing noise never
# picks it: on the Xeon the split took 2.3-4x F.linear's time, on the EPYC 0.6-0.7x.
# It is timed in two rounds; a verdict is kept for the machine only when both rounds give it
# decisively (below the margin, or over 1x).
PROBE_SHAPE = (4096, 2048)
PROBE_MARGIN = 0.8
PROBE_REPEAT = 9

# (dtype, threads) -> whether the split beat F.linear on this machine
_split_pays: dict[tuple[torch.dtype, int], bool] = {}


def threads() -> int:
    """The intra-op thread count. A compiled decode step marks this function constant (so
    its graph keeps the count it was traced with); marking it here would import
    torch._dynamo, and with it triton, on every `import kernels`."""
    return torch.get_num_threads()


def split_linear(x2: torch.Tensor, weight: torch.Tensor, blocks: int) -> torch.Tensor:
    """x2 (rows, in) @ weight.T, weight's output rows as `blocks` batched blocks -> (rows, out)."""
    out_features, in_features = weight.shape
    rows = x2.shape[0]
    w3 = weight.view(blocks, out_features // blocks, in_features)
    y = torch.bmm(w3, x2.t().expand(blocks, in_features, rows)).view(out_features, rows).t()
    return y.contiguous() if rows > 1 else y


def _medians_s(*fns) -> list[float]:
    """Median seconds of each function, timed in alternation after a few warm-up calls (the
    BLAS's first calls for a new shape are slow), so drifts in load hit all alike."""
    for _ in range(3):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(PROBE_REPEAT):
        for fn, ts in zip(fns, times, strict=True):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [sorted(ts)[len(ts) // 2] for ts in times]


def split_pays(dtype: torch.dtype) -> bool:
    """Whether splitting few-row products over the threads beats F.linear on this machine for
    `dtype`: timed once per machine, (dtype, thread count) and torch version (~0.1 s), and
    remembered in the cache folder (`~/.cache/zoo/cpu_split.json`), so that every process on a
    machine takes the same path: a verdict timed afresh in each process could differ with the
    load of the moment, and with it a process's speed. Only a verdict given decisively by two
    rounds is remembered (the split under 0.8x, or over 1x, F.linear's time); otherwise the
    next process times it again. `ZOO_CPU_SPLIT=0|1` decides instead.
    Decode steps call it when they are built, so no request pays for it (and a compiled
    step's graph bakes the verdict in)."""
    blocks = threads()
    key = (dtype, blocks)
    if key not in _split_pays:
        forced = os.environ.get("ZOO_CPU_SPLIT")
        remembered = _remembered(key)
        if forced in ("0", "1"):
            _split_pays[key] = forced == "1"
        elif blocks < 2:
            _split_pays[key] = False
        elif remembered is not None:
            _split_pays[key] = remembered
        else:
            g = torch.Generator().manual_seed(0)
            out = PROBE_SHAPE[0] // blocks * blocks  # one equal block per thread
            w = torch.randn(out, PROBE_SHAPE[1], generator=g).to(dtype)
            x = torch.randn(1, PROBE_SHAPE[1], generator=g).to(dtype)
            verdicts = set()
            with torch.inference_mode():
                for _ in range(2):
                    plain, split = _medians_s(
                        lambda: F.linear(x, w), lambda: split_linear(x, w, blocks)
                    )
                    verdicts.add(True if split < PROBE_MARGIN * plain else
                                 False if split > plain else None)  # fmt: skip
            _split_pays[key] = verdicts == {True}
            if len(verdicts) == 1 and None not in verdicts:  # decisive, twice: kept
                _remember(key, _split_pays[key])
            # otherwise (what a probe timed beside other busy processes tends to show: the
            # split needs both threads at once), this process does without and the next one
            # times it again, instead of a verdict of a loaded moment standing for good
    return _split_pays[key]


def cache_dir() -> Path:
    """Where Zoo remembers things per machine: `$ZOO_CACHE`, else `~/.cache/zoo`."""
    root = os.environ.get("ZOO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "zoo"
    )
    return Path(root)


def _verdicts_file() -> Path:
    return cache_dir() / "cpu_split.json"


def _machine_key(key: tuple[torch.dtype, int]) -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)  # fmt: skip
    except OSError:
        pass
    return f"{model} | {key[1]} threads | {key[0]} | torch {torch.__version__}"


def _remembered(key: tuple[torch.dtype, int]) -> bool | None:
    try:
        verdict = json.loads(_verdicts_file().read_text()).get(_machine_key(key))
    except (OSError, ValueError, AttributeError):
        return None
    return verdict if isinstance(verdict, bool) else None


def _remember(key: tuple[torch.dtype, int], verdict: bool) -> None:
    path = _verdicts_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        known = known if isinstance(known, dict) else {}
        known[_machine_key(key)] = verdict
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: processes probing at once each write a whole file
    except OSError:
        pass  # a read-only home: timed again in the next process


def _pays(dtype: torch.dtype) -> bool:
    """split_pays, except that code being traced by torch.compile only reads what an earlier
    eager call measured (timing inside a trace would bake the probe into the graph)."""
    if torch.compiler.is_compiling():
        return _split_pays.get((dtype, threads()), False)
    return split_pays(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), split over the intra-op threads when x has few rows and the
    split pays on this machine (`split_pays`)."""
    out_features, in_features = weight.shape
    blocks = threads()
    rows = x.numel() // in_features
    split = x.shape[-1] == in_features and rows <= MAX_ROWS and weight.is_contiguous()
    if blocks < 2 or out_features % blocks or not split or not _pays(weight.dtype):
        return F.linear(x, weight, bias)  # F.linear also reports bad shapes
    y = split_linear(x.reshape(rows, in_features), weight, blocks)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], out_features)
