"""The scheduler thread of `zoo serve`: it owns the model and runs requests by continuous
batching over the rows (slots) of the static KV cache.

A request waits in a FIFO queue until a row is free, then holds that row until it ends (done,
or cancelled when its client goes away) and frees it between two steps. Each step
- prefills waiting prompt tokens in chunks, oldest request first, under a token budget
  (`chunk`, less one token per decoding row), so a long prompt cannot stall the others;
- then runs one decode step for every decoding row together (the model's `DecodeStep`:
  compiled / CUDA-graph buckets included), each row at its own position.
A row keeps its tokens' keys and values after its request ends: a later prompt starts from
the longest prefix any row holds (core/serve/slots.py). See docs/architecture.md for why the cache
stays static (one row per request) rather than paged.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import torch

from core.model import Model
from core.modeling import kernel_errors
from core.serve.metrics import ServerMetrics
from core.serve.seq import Job, Seq
from core.serve.slots import Slots

log = logging.getLogger("zoo.server")
CHUNK = 512  # prompt tokens prefilled per step, decoding rows included (vLLM's
# max_num_batched_tokens): smaller keeps other rows' inter-token latency lower on CPUs


class ShuttingDown(Exception):
    """Handed to requests still queued when the server stops."""


class QueueFull(Exception):
    """A request that found `max_queue` requests already waiting (the server answers 503)."""


class Cancelled(Exception):
    """Handed to a request cancelled while it waited in the queue (it never runs)."""


class Scheduler:
    """The thread that owns the model: admits queued jobs into free rows, steps the rows."""

    def __init__(
        self, model: Model, metrics: ServerMetrics | None = None, max_queue: int | None = None
    ):
        self.model = model
        self.metrics = metrics or ServerMetrics("")
        self.max_queue = max_queue  # None: unbounded
        self.chunk = CHUNK
        self.reuse = True  # start prompts from a prefix some row holds
        self.slots = Slots(model.net.kv_cache, model.config.attention_layers)
        self.waiting: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.pending: deque[Job] = deque()  # taken off `waiting`, not yet in a row (FIFO)
        self.queued = 0  # jobs submitted and not yet in a row
        self._count = threading.Lock()
        self.running: list[Seq] = []  # in admission order
        self._stopping = False
        v = model.config.vocab_size  # penalties' per-row state, reset when a row is taken
        self.counts = torch.zeros(model.max_batch_size, v, device=model.device)
        self.seen = torch.zeros(model.max_batch_size, v, dtype=torch.bool, device=model.device)
        self._thread = threading.Thread(target=self._serve, name="zoo-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self.waiting.put(None)
        self._thread.join(timeout=30)

    def submit(self, job: Job) -> None:
        """Queue `job` (FIFO); QueueFull when max_queue jobs already wait."""
        with self._count:
            if self.max_queue is not None and self.queued >= self.max_queue:
                raise QueueFull(f"{self.queued} requests are already waiting (--max-queue)")
            self.queued += 1
        job.clock = self.metrics.submitted()
        self.waiting.put(job)

    # --- the loop ------------------------------------------------------------------------------
    def _serve(self) -> None:
        while self._take(block=not self.running and not self.pending):
            self._admit()
            if self.running:
                self._step()
        for seq in self.running:  # stopping: rows end as aborted, queued jobs get an error
            seq.abort()
            self._end(seq)
        while True:  # what was submitted meanwhile, too
            try:
                job = self.waiting.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self.pending.append(job)
        for job in self.pending:
            self._dequeue(job, running=False)
            job.emit("error", ShuttingDown("the server is shutting down"))

    def _take(self, block: bool) -> bool:
        """Move what was submitted into `pending` (waiting for one job if `block`); False
        once the server stops."""
        while True:
            try:
                job = self.waiting.get(block=block)
            except queue.Empty:
                return not self._stopping
            if job is None:
                return False
            self.pending.append(job)
            block = False

    def _dequeue(self, job: Job, running: bool) -> None:
        with self._count:
            self.queued -= 1
        self.metrics.dequeued(job.clock, running=running)

    def _admit(self) -> None:
        """Pending jobs into free rows, first come first served."""
        while self.pending and self.slots.free:
            job = self.pending.popleft()
            if job.cancelled:
                self._dequeue(job, running=False)
                job.emit("error", Cancelled("the client went away before its request ran"))
                continue
            self._dequeue(job, running=True)
            row, cached = self.slots.acquire(job.ids, self.reuse)
            try:
                seq = Seq(job, row, cached, self.model, self.metrics)
            except Exception as err:  # e.g. a grammar that cannot be built: this job only
                log.exception("zoo: a request could not start")
                self.slots.release(row)
                self.metrics.finished(job.clock, None)
                job.emit("error", err)
                continue
            self.metrics.prefix(len(job.ids), cached)
            self.counts[row].zero_()
            self.seen[row].zero_()
            self.seen[row, job.ids] = True
            self.running.append(seq)

    def _end(self, seq: Seq) -> None:
        result = seq.result()
        log.debug(
            "zoo: row %d: %d prompt tokens (%d cached), %d new, %s",
            seq.row, len(seq.ids), seq.cached, len(result.token_ids), result.finish_reason,
        )  # fmt: skip
        self.metrics.finished(seq.job.clock, result)
        seq.job.emit("done", result)
        self.slots.release(seq.row)

    def _step(self) -> None:
        try:
            with torch.inference_mode(), kernel_errors():  # a kernel's refusal: a ZooError
                for seq in self.running:
                    if seq.job.cancelled:
                        seq.abort()
                self._prefill()
                self._decode()
        except Exception as err:  # answer every running row, keep serving
            log.exception("zoo: a step of %d requests failed", len(self.running))
            for seq in self.running:
                self.metrics.finished(seq.job.clock, None)
                seq.job.emit("error", err)
                self.slots.release(seq.row)
            self.running = []
            self.slots.forget()  # what the rows hold is unknown now
            return
        for seq in [s for s in self.running if s.finish]:
            self.running.remove(seq)
            self._end(seq)

    def _prefill(self) -> None:
        """One chunk of prompt per prefilling row, oldest first, while the budget lasts. A
        recurrent model prefills a prompt whole: its state must not see a decode step's
        placeholder token between two chunks."""
        net, slots = self.model.net, self.slots
        budget = self.chunk - sum(s.decoding for s in self.running)
        for seq in [s for s in self.running if not s.finish and not s.decoding]:
            left = len(seq.ids) - len(slots.fed[seq.row])
            n = left if slots.recurrent else min(left, budget)
            if n <= 0:
                break
            budget -= n
            start = len(slots.fed[seq.row])
            chunk = seq.ids[start : start + n]
            ids = torch.tensor([chunk], device=self.model.device)
            with slots.only(seq.row):
                logits = net(ids, start, logits_at=torch.tensor([n - 1], device=ids.device))
            slots.fed[seq.row].extend(chunk)
            if n == left:  # the prompt's last token: its logits give the first new token
                seq.first(logits[:, 0].float(), self.counts, self.seen)

    def _decode(self) -> None:
        """One token for every decoding row. Where the step takes a list of cache rows (the
        fused CPU step), it computes just those. Otherwise it runs rows [:k] of the cache,
        and a row in [:k] that is not decoding (free, or between prefill chunks) takes a
        placeholder token at its next position, which it has not filled yet: what it holds
        stays intact (in a ring, that slot holds the position one window back, which no later
        query of the row reads; a row that held a whole window is not reused)."""
        rows = [s for s in self.running if s.decoding and not s.finish]
        if not rows:
            return
        fed, dev = self.slots.fed, self.model.device
        if self.model.step.takes_rows(len(rows)):
            at = [s.row for s in rows]
            tokens, pos, where = [s.last for s in rows], [len(fed[r]) for r in at], at
        else:
            k = max(s.row for s in rows) + 1
            if self.model.step.compiled is not None:  # a few batch sizes to compile: 2^n
                k = min(1 << (k - 1).bit_length(), self.model.max_batch_size)
            tokens, pos, where = [0] * k, [len(fed[r]) for r in range(k)], None
            for s in rows:
                tokens[s.row] = s.last
        logits = self.model.step(
            torch.tensor(tokens, device=dev),
            torch.tensor(pos, device=dev),
            max(pos) + 1,
            rows=None if where is None else torch.tensor(where, device=dev),
        )
        for s in rows:
            fed[s.row].append(s.last)
        Seq.sample(
            rows, logits, self.counts, self.seen, None if where is None else list(range(len(rows)))
        )
