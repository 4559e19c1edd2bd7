"""Tensor-parallel MoE: each expert split over the N ranks (what core/parallel/tp.py does) against
expert parallelism (E / N whole experts per rank), timed as one rank's share of a MoE layer.

Both schemes end in the same all-reduce of (tokens, hidden), so what differs is each rank's
expert work, and a layer waits for its slowest rank: for the split that is any rank (all do
1/N of every chosen expert), for expert parallelism the rank whose experts were chosen most.
One process times every rank's share in turn, single-threaded (a rank per core), with the
routed-expert loop of kernels/reference.py (gather each expert's tokens, two matmuls).
Routing: top-k of softmax(random logits) ("even"), and with a Zipf-like bias toward a few
experts ("skewed", as popular experts are in real checkpoints).

    python benchmarks/tp_moe.py [--hidden 1024] [--inter 256] [--experts 64] [--top-k 6]
                                [--ranks 4] [--tokens 1,16,256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F


def experts_forward(x, ids, weights, gate_up, down, owned: dict[int, int]) -> torch.Tensor:
    """sum over the picks of experts in `owned` (global id -> index into gate_up / down)."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        if e not in owned:
            continue
        token, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = (x[token] @ gate_up[owned[e]].T).chunk(2, dim=-1)
        h = (F.silu(gate) * up) @ down[owned[e]].T
        out.index_add_(0, token, h * weights[token, slot, None])
    return out


def timed(repeat: int, *args) -> float:
    """Median seconds of experts_forward(*args)."""
    fn = functools.partial(experts_forward, *args)
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=256, help="each expert's intermediate size")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", default="1,16,256")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    h, i, e, n, k = args.hidden, args.inter, args.experts, args.ranks, args.top_k
    gate_up = torch.randn(e, 2 * i, h, generator=g) * 0.02
    down = torch.randn(e, h, i, generator=g) * 0.02
    # the split: every expert's rows [r*I/N, (r+1)*I/N) of gate and up, columns of down (rank 0)
    s = slice(0, i // n)
    split_gu = torch.cat((gate_up[:, s], gate_up[:, i : i + i // n]), dim=1).contiguous()
    split_down = down[:, :, s].contiguous()
    per = e // n
    print(f"H={h} I={i} E={e} top-{k}, {n} ranks; median of {args.repeat}, one thread, ms")
    head = ("routing", "tokens", "split", "EP slowest", "EP mean", "EP/split")
    print("{:8} {:>6} {:>9} {:>11} {:>9} {:>9}".format(*head))
    bias = -torch.log(torch.arange(1, e + 1).float()) * 1.5  # Zipf-like popularity
    for routing in ("even", "skewed"):
        for t in (int(x) for x in args.tokens.split(",")):
            x = torch.randn(t, h, generator=g)
            logits = torch.randn(t, e, generator=g) + (bias if routing == "skewed" else 0)
            weights, ids = logits.softmax(-1).topk(k, dim=-1)
            everyone = {j: j for j in range(e)}
            split = timed(args.repeat, x, ids, weights, split_gu, split_down, everyone)
            ep = []
            for r in range(n):
                owned = {r * per + j: j for j in range(per)}
                gu, dn = gate_up[r * per : (r + 1) * per], down[r * per : (r + 1) * per]
                ep.append(timed(args.repeat, x, ids, weights, gu, dn, owned))
            slowest, mean = max(ep), statistics.mean(ep)
            print(f"{routing:8} {t:>6} {split * 1e3:>9.3f} {slowest * 1e3:>11.3f} "
                  f"{mean * 1e3:>9.3f} {slowest / split:>9.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
