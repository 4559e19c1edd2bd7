"""Time to first token of a chat's next turn on a recurrent hybrid, with and without prefix reuse
(core/slots.py): a 2,000-token conversation, then
- the next turn (its reply and ~50 new tokens appended): resumes after the whole history;
- a turn diverging ~100 tokens before the history's end (an edited message): resumes at the
  last snapshot of the row's state inside the shared prefix (every 256 tokens, 8 per row);
- both cold: a fresh row reads the whole prompt.
Each greedy reply (fp32) must be the cold run's, token for token. Random weights; the model is
one of linear_decode.py's hybrids (3 recurrent layers : 1 attention, 8 layers, hidden 512):
`--family qwen3.5` gated DeltaNet (the default), `granite` Mamba2, `lfm2` short convs; or
--shape names a JSON file of config.json keys. Medians of --repeat runs, each from a
fresh engine whose row first reads the conversation (untimed). Prints a markdown table.

    .venv/bin/python benchmarks/recurrent_reuse.py [--family qwen3.5|granite|lfm2]
        [--shape FILE.json] [--history 2000]
        [--repeat 5] [--device cpu] [--cpu-time]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

import torch

from benchmarks.linear_decode import FAMILIES
from core.cli.bench import random_model
from core.engine import Engine
from core.generation import Seq
from core.kv_cache import SNAPSHOTS
from core.sampling import SamplingParams

REPLY, ADDED, DIVERGE = 16, 50, 100  # tokens: each reply, a new turn's own, the edit's distance


CLOCK = time.perf_counter  # --cpu-time: time.thread_time


def first_token(engine: Engine, ids: list[int], vocab: int, device) -> tuple[float, Seq]:
    """(seconds to the first token, the sequence once its reply is done)."""
    p = SamplingParams(max_new_tokens=REPLY, temperature=0.0, ignore_eos=True)
    s = Seq(ids, p, set(), None, vocab, device)
    t0 = CLOCK()
    engine.add(s)
    while not s.out:
        engine.step()
    ttft = CLOCK() - t0
    while engine.running:
        engine.step()
    return ttft, s


def one_run(model, history: list[int], added: list[int]) -> dict[str, tuple[float, Seq]]:
    """TTFT and reply of the next turn and of the edited one, resumed and cold."""
    vocab, dev, out = model.config.vocab_size, model.device, {}
    for name in ("next turn", "edited turn"):
        warm = Engine(model, 1, reuse=True)
        _, first = first_token(warm, history, vocab, dev)  # the conversation so far
        turn = history + first.out + added if name == "next turn" else history[:-DIVERGE] + added
        out[name] = first_token(warm, turn, vocab, dev)
        out[name + " cold"] = first_token(Engine(model, 1), turn, vocab, dev)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    hybrids = [f for f, (_, kinds) in FAMILIES.items() if "hybrid 3:1" in kinds]
    ap.add_argument("--family", choices=hybrids, default="qwen3.5")
    ap.add_argument("--shape", type=Path, default=None, help="config.json keys of the model")
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="one thread, timed by its CPU time (time.thread_time): the work to the first "
        "token, not the time other processes on a shared machine take from it",
    )
    args = ap.parse_args()
    if args.cpu_time:
        global CLOCK
        torch.set_num_threads(1)
        CLOCK = time.thread_time
    if args.shape:
        shape = json.loads(args.shape.read_text())
    else:  # the family's 3 : 1 hybrid
        base, kinds = FAMILIES[args.family]
        shape = dict(base, layer_types=kinds["hybrid 3:1"])
    seq = args.history + 2 * REPLY + ADDED + 8
    model = random_model(shape, device=args.device, dtype="float32", max_seq_len=seq,
                         max_batch_size=1, snapshots=SNAPSHOTS)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(3, shape["vocab_size"], (n,), generator=g).tolist()  # noqa: E731
    history, added = draw(args.history), draw(ADDED)
    with torch.inference_mode():
        one_run(model, history[:300], added)  # warm-up: first calls build what a step needs
        runs = [one_run(model, history, added) for _ in range(args.repeat)]
    cache = model.net.kv_cache
    print(f"`{' '.join(['python', *sys.argv])}`")
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, {model.device}, float32, {datetime.date.today()}; "
        f"{shape['model_type']} {shape.get('layer_types', '')}; snapshots {cache.snapshots} "
        f"every {cache.snapshot_interval} tokens ({cache.snapshot_bytes / 2**20:.1f} MiB a row)"
        + ("; CPU time of one thread" if args.cpu_time else "; wall time")
    )
    print()
    print("| turn | prompt tokens | resumed at | TTFT cold (ms) | TTFT reused (ms) | speed-up "
          "| greedy reply = cold |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in ("next turn", "edited turn"):
        cold = statistics.median(r[name + " cold"][0] for r in runs) * 1e3
        warm = statistics.median(r[name][0] for r in runs) * 1e3
        s = runs[-1][name][1]
        same = all(r[name][1].out == r[name + " cold"][1].out for r in runs)
        print(f"| {name} | {len(s.ids)} | {s.cached} | {cold:.1f} | {warm:.1f} | "
              f"{cold / warm:.1f}x | {'yes' if same else 'NO'} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
