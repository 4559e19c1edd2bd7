"""CPU fast paths: the same torch math, arranged for how the BLAS parallelizes on few cores.

`linear`: for a few rows (decode: one token per sequence), MKL runs y = x @ W.T on one thread
at ~14 GB/s on the 2-core CI machine although two threads read ~36 GB/s. Viewing W's output
rows as `threads` contiguous blocks and multiplying them as one batched matmul gives each
thread its own block: 1.3-1.9x at one row, 2.1-3.3x at four (`benchmarks/cpu_linear.py`).
Results equal F.linear's to float rounding (the same dot products, summed in another order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Eager, the split wins up to 8 rows and breaks even at 16; in a compiled step inductor turns
# it into its own loops, which beat MKL at 16 rows too (batch-16 decode 91 -> 76 ms/step).
MAX_ROWS = 16


def threads() -> int:
    """The intra-op thread count. A compiled decode step marks this function constant (so
    its graph keeps the count it was traced with); marking it here would import
    torch._dynamo, and with it triton, on every `import kernels`."""
    return torch.get_num_threads()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), split over the intra-op threads when x has few rows."""
    out_features, in_features = weight.shape
    blocks = threads()
    rows = x.numel() // in_features
    split = x.shape[-1] == in_features and rows <= MAX_ROWS and weight.is_contiguous()
    if blocks < 2 or out_features % blocks or not split:  # F.linear also reports bad shapes
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, in_features)
    w3 = weight.view(blocks, out_features // blocks, in_features)
    y = torch.bmm(w3, x2.t().expand(blocks, in_features, rows)).view(out_features, rows).t()
    if rows > 1:
        y = y.contiguous()
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], out_features)
