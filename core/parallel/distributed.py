"""torch.distributed for tensor parallelism (core/parallel/tp.py): the process group, the two
collectives a sharded model runs, rank 0 driving the others, and the launcher.

- `start` joins the group torchrun's environment describes (gloo on CPUs, NCCL on GPUs), or
  one the caller initialized; every collective has a timeout (`ZOO_TP_TIMEOUT`, seconds), and
  a failed one (a rank died: its sockets closed) raises `DistributedError`, never hangs.
- Library use is SPMD: every rank calls the same `forward` / `generate` (same prompts, same
  seed), and every rank gets the same logits (gathered) and so the same tokens.
- The CLI and the server let rank 0 drive: `lead` sets the network's `lead` hook, with which
  each forward first broadcasts its arguments (its cache row included), and each copy between
  cache rows (the engine's prefix reuse) and each keep / rewind of a row's rings (speculative
  decoding's rejected drafts) too; `follow` runs on the other ranks, replaying each
  until rank 0 `finish`es.
  Only rank 0 samples, streams, prints and serves; a heartbeat keeps an idle group alive.
- `launch` starts N ranks of `python -m core.cli ...` through torch.distributed.run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from core.errors import ConfigError, DistributedError

TIMEOUT_S = float(os.environ.get("ZOO_TP_TIMEOUT", "300"))
_STOP, _FORWARD, _BEAT, _COPY, _KEEP, _REWIND = 0, 1, 2, 3, 4, 5
_lock = threading.Lock()  # rank 0: one broadcast + forward at a time (heartbeats wait)
_state: dict = {"leading": False, "stop": None}


def start(tp: int, device: torch.device) -> torch.device:
    """Join the group of `tp` ranks (creating it from torchrun's environment variables when
    none is initialized); returns this rank's device (cuda:LOCAL_RANK on GPUs)."""
    if not dist.is_available():
        raise ConfigError(f"tp={tp}: this torch build has no torch.distributed; use tp=1")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
            raise ConfigError(
                f"tp={tp} needs {tp} processes in a torch.distributed group: start them with "
                f"`zoo run MODEL --tp {tp}` or `torchrun --nproc-per-node {tp} -m core.cli run "
                "MODEL`, or call torch.distributed.init_process_group() on each first"
            )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=TIMEOUT_S))
    world = dist.get_world_size()
    if world != tp:
        raise ConfigError(
            f"tp={tp} but the torch.distributed group has {world} ranks; pass tp={world} or "
            f"start {tp} ranks"
        )
    return device


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _guard(op, *args) -> None:
    """Run one collective; a failure (a peer closed its connection, or passed the timeout)
    becomes a one-line `DistributedError` instead of a backend traceback."""
    try:
        op(*args)
    except RuntimeError as err:  # gloo and NCCL raise DistBackendError, a RuntimeError
        text = re.sub(r"^\[[^\]]*\]\s*", "", str(err).strip())  # drop gloo's source location
        what = text.split(". ")[0][:160] or type(err).__name__
        raise DistributedError(
            f"rank {rank()} of {world_size()}: a collective failed ({what}); another rank died, "
            f"or stopped answering for longer than {TIMEOUT_S:g} s (ZOO_TP_TIMEOUT), so this "
            "one stops too"
        ) from None


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the ranks, in place; returns it."""
    _guard(dist.all_reduce, t)
    return t


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """The ranks' `t` concatenated along the last dim, in rank order, on every rank."""
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(world_size())]
    _guard(dist.all_gather, parts, t)
    return torch.cat(parts, dim=-1)


# --- rank 0 drives, the others follow --------------------------------------------------------
def _wire(device: torch.device) -> torch.device:
    """Where broadcast tensors live: the GPU for NCCL, the CPU for gloo."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def _header(*values: int, device) -> torch.Tensor:
    return torch.tensor(values + (0,) * (10 - len(values)), dtype=torch.int64, device=device)


class Lead:
    """Rank 0's `net.lead`: before each forward of the network (and each copy between cache
    rows), it broadcasts the call to the followers, which replay it (`follow`)."""

    def __init__(self, wire: torch.device):
        self.wire = wire

    @contextlib.contextmanager
    def forward(self, input_ids, start_pos, end, logits_at, lengths, row):
        b, t = input_ids.shape
        per_row = isinstance(start_pos, torch.Tensor)
        head = (_FORWARD, b, t, int(per_row), 0 if per_row else int(start_pos),
                -1 if end is None else int(end), int(logits_at is not None),
                int(lengths is not None), -1 if row is None else row)  # fmt: skip
        with _lock:  # held over the forward: its collectives come right after the broadcast
            _guard(dist.broadcast, _header(*head, device=self.wire), 0)
            for x in (input_ids, start_pos if per_row else None, logits_at, lengths):
                if x is not None:
                    _guard(dist.broadcast, x.to(self.wire, torch.int64).contiguous(), 0)
            yield

    def copy(self, src: int, dst: int, n: int) -> None:
        with _lock:
            _guard(dist.broadcast, _header(_COPY, src, dst, n, device=self.wire), 0)

    def keep(self, row: int, start: int, n: int) -> None:
        with _lock:
            _guard(dist.broadcast, _header(_KEEP, row, start, n, device=self.wire), 0)

    def rewind(self, row: int, n: int) -> None:
        with _lock:
            _guard(dist.broadcast, _header(_REWIND, row, n, device=self.wire), 0)


def lead(net: torch.nn.Module, device: torch.device) -> None:
    """Rank 0: every forward of `net` and every copy between its cache rows first goes to
    the followers (`net.lead`); a heartbeat keeps an idle group alive."""
    wire = _wire(device)
    net.lead = Lead(wire)
    stop = threading.Event()

    def beat() -> None:  # an idle server must not let the followers' broadcast time out
        while not stop.wait(TIMEOUT_S / 4):
            with _lock:
                try:
                    dist.broadcast(_header(_BEAT, device=wire), 0)
                except RuntimeError:
                    return

    threading.Thread(target=beat, name="zoo-tp-heartbeat", daemon=True).start()
    _state.update(leading=True, stop=stop, wire=wire, net=net)


@torch.inference_mode()
def follow(net: torch.nn.Module, device: torch.device) -> None:
    """Ranks > 0: run each forward and row copy rank 0 announces, until it sends stop. Ctrl-C
    is rank 0's to act on (a terminal sends it to every rank): these ranks end when it says
    so, or dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wire = _wire(device)
    kept = {}  # per row: what a speculative verify overwrote (`keep`), until its `rewind`
    while True:
        head = _header(device=wire)
        _guard(dist.broadcast, head, 0)
        cmd, b, t, per_row, start, end, has_at, has_len, row, _ = head.tolist()
        if cmd == _STOP:
            return
        if cmd == _COPY:  # (src, dst, n) in the b, t, per_row fields
            net.kv_cache.copy(b, t, per_row)
        if cmd == _KEEP:  # (row, start, n)
            kept[b] = net.kv_cache.keep(b, t, per_row)
        if cmd == _REWIND:  # (row, n)
            net.kv_cache.rewind(b, kept.pop(b), t)
        if cmd != _FORWARD:
            continue

        def receive(*shape: int) -> torch.Tensor:
            x = torch.empty(shape, dtype=torch.int64, device=wire)
            _guard(dist.broadcast, x, 0)
            return x.to(device)

        ids = receive(b, t)
        start_pos = receive(b) if per_row else start
        logits_at = receive(b) if has_at else None
        lengths = receive(b) if has_len else None
        net.run(
            ids, start_pos, None if end < 0 else end, logits_at, lengths, None if row < 0 else row
        )


def release() -> None:
    """Rank 0: tell the followers to return from `follow` (the group stays up)."""
    if _state["leading"]:
        _state["stop"].set()
        # a follower already gone: the launcher reports it
        with _lock, contextlib.suppress(RuntimeError):
            dist.broadcast(_header(_STOP, device=_state["wire"]), 0)
        _state["net"].lead = None
        _state["leading"] = False


def finish() -> None:
    """Rank 0: `release` the followers; every rank: leave the group."""
    release()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# --- the launcher ----------------------------------------------------------------------------
def launch(n: int, argv: list[str]) -> int:
    """Run `python -m core.cli *argv` as `n` ranks on this machine through
    torch.distributed.run (torchrun) and wait for them; a rank that fails stops the others."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if n < 1:
        raise ConfigError(f"--tp {n}: the number of ranks must be at least 1")
    if not logging.getLogger().isEnabledFor(logging.DEBUG):  # torchrun's notes, unless --debug
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # torchrun would set 1 thread per rank (and warn); split the cores instead
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={n}", "--max-restarts=0", "--module", "core.cli", *argv]
    )
    try:
        run(args)
    except SignalException as err:  # Ctrl-C / SIGTERM: torchrun stopped the ranks
        raise KeyboardInterrupt from err
    except ChildFailedError as err:
        rank0, failure = err.get_first_failure()
        how = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"code {failure.exitcode}"
        raise DistributedError(
            f"--tp {n}: rank {rank0} exited with {how} (its error, if any, is above) and the "
            "other ranks were stopped"
        ) from None
    return 0
