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

import time

import torch
import torch.nn.functional as F

# Eager, the split wins up to 8 rows and breaks even at 16 on the EPYC; in a compiled step
# inductor turns it into its own loops, which beat MKL at 16 rows there too (batch-16 decode
# 91 -> 76 ms/step).
MAX_ROWS = 16
# The probe: a one-row product with a ~1024 x 2048 weight (8 MiB in fp32: long enough to time
# in ~0.2 ms, small enough to stay in cache, where a one-thread GEMV shows as plainly as in
# DRAM). The split must beat F.linear by PROBE_MARGIN, so timing noise never picks it: on the
# Xeon the split takes 2.3-4x F.linear's time here, on the EPYC 0.5-0.6x (streaming).
PROBE_SHAPE = (2048, 1024)
PROBE_MARGIN = 0.8
PROBE_REPEAT = 15

# (dtype, threads) -> whether the split beat F.linear on this machine
_split_pays: dict[tuple[torch.dtype, int], bool] = {}


def threads() -> int:
    """The intra-op thread count. A compiled decode step marks this function constant (so
    its graph keeps the count it was traced with); marking it here would import
    torch._dynamo, and with it triton, on every `import kernels`."""
    return torch.get_num_threads()


def _split(x2: torch.Tensor, weight: torch.Tensor, blocks: int) -> torch.Tensor:
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
    `dtype`: timed on the first call per (dtype, thread count) (~30 ms), then remembered.
    Decode steps call it when they are built, so no request pays for it (and a compiled
    step's graph bakes the verdict in)."""
    blocks = threads()
    key = (dtype, blocks)
    if key not in _split_pays:
        if blocks < 2:
            _split_pays[key] = False
        else:
            g = torch.Generator().manual_seed(0)
            out = PROBE_SHAPE[0] // blocks * blocks  # one equal block per thread
            w = torch.randn(out, PROBE_SHAPE[1], generator=g).to(dtype)
            x = torch.randn(1, PROBE_SHAPE[1], generator=g).to(dtype)
            with torch.inference_mode():
                plain, split = _medians_s(lambda: F.linear(x, w), lambda: _split(x, w, blocks))
            _split_pays[key] = split < PROBE_MARGIN * plain
    return _split_pays[key]


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
    y = _split(x.reshape(rows, in_features), weight, blocks)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], out_features)
