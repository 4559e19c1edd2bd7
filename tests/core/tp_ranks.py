"""What each rank of the tensor-parallel tests runs, in a spawned process of its own (imported
by name there, so nothing here imports the core at module level: the timeout is read from the
environment when core.parallel.distributed is first imported)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import torch

PROMPT = [5, 17, 42, 8, 23, 61, 7, 30, 11]
NEXT = [[19], [44]]  # one decode token per row of a batch of two


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, world: int, port: int, timeout_s: float) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        ZOO_TP_TIMEOUT=str(timeout_s),
    )
    torch.set_num_threads(1)  # two ranks on a shared machine


def measure(model, tp: int) -> dict:
    """The figures compared across tp sizes: prefill logits of a batch of two, one decode
    step, greedy tokens, seeded sampled tokens, parameter bytes."""
    from core.parallel.tp import resident_bytes

    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    prefill = model.forward(ids)
    step = model.forward(torch.tensor(NEXT), start_pos=len(PROMPT))
    greedy = model.generate(PROMPT, max_new_tokens=8, temperature=0.0, ignore_eos=True)
    sampled = model.generate(
        PROMPT, max_new_tokens=8, temperature=1.0, top_k=0, seed=3, ignore_eos=True
    )
    return dict(
        prefill=prefill.float(),
        step=step.float(),
        greedy=greedy.token_ids,
        sampled=sampled.token_ids,
        bytes=resident_bytes(model.net),
        tp=tp,
    )


SPEC = {"method": "ngram", "k": 3, "adaptive": False, "ngram_min": 1}


def speculate(model) -> tuple[list[int], list[float], int, int]:
    """Greedy tokens past a sliding window (its ring wraps), their log-probabilities, tokens
    drafted, accepted."""
    res = model.generate(
        PROMPT * 2, max_new_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0
    )
    lps = [t.logprob for t in res.logprobs]
    spec = res.speculation
    return res.token_ids, lps, spec.draft_tokens if spec else 0, spec.accepted_tokens if spec else 0


@torch.inference_mode()
def rows_and_copies(model) -> torch.Tensor:
    """What the server's engine does besides plain forwards: prefill one row of the cache
    (`row=`), copy a prefix into another row (`copy_rows`), continue that row, then decode
    both rows at per-row positions. Their logits (2, 1, vocab)."""
    net = model.net
    net(torch.tensor([PROMPT]), 0, row=1)
    net.copy_rows(1, 0, 5)
    net(torch.tensor([PROMPT[5:][::-1]]), 5, row=0)
    return net(torch.tensor(NEXT), torch.tensor([len(PROMPT)] * 2)).float()


def parity_rank(rank: int, world: int, port: int, folders: dict, out: str) -> None:
    """Load each folder with tp=world and save this rank's figures; rank 0 drives the scheduler's
    row operations on llama3.2 (rows.pt: its logits). Then rank 1 dies, and
    rank 0's next forward must fail quickly and by name: rank0.txt holds how long it took and
    the error; the exit codes are 1 (rank 0, the error) and 3 (rank 1)."""
    _join(rank, world, port, 30)
    from core import ZooError, load_model
    from core.parallel import distributed
    from core.parallel.distributed import all_reduce

    results = {}
    for name, folder in folders.items():
        model = load_model(folder, tp=world, max_seq_len=64, max_batch_size=2)
        results[name] = measure(model, world)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    # rank 0 drives, as zoo serve does: rows and copies must reach rank 1's cache too
    model = load_model(folders["llama3.2"], tp=world, max_seq_len=64, max_batch_size=2)
    if rank == 0:
        distributed.lead(model.net, model.device)
        torch.save(rows_and_copies(model), Path(out) / "rows.pt")
        distributed.release()
    else:
        distributed.follow(model.net, model.device)
    # speculative decoding driven by rank 0 on sliding layers: rank 1's rings are rewound too
    model = load_model(
        folders["gemma4"], tp=world, max_seq_len=64, max_batch_size=2, speculative=SPEC
    )
    if rank == 0:
        distributed.lead(model.net, model.device)
        torch.save(speculate(model), Path(out) / "spec.pt")
        distributed.release()
    else:
        distributed.follow(model.net, model.device)
    all_reduce(torch.zeros(1))  # both saved
    if rank == 1:
        os._exit(3)
    time.sleep(0.5)  # rank 1 is gone
    t0 = time.perf_counter()
    try:
        model.forward(torch.tensor([PROMPT]))
        message = None
    except ZooError as err:
        message = f"{type(err).__name__}: {err}"
    (Path(out) / "rank0.txt").write_text(f"{time.perf_counter() - t0}\n{message}")
    distributed.finish()  # as `zoo` does on its way out (leaving the group is what ends it cleanly)
    raise SystemExit(0 if message is None else 1)
