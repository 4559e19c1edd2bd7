"""The scheduler thread of `zoo serve`: it owns the model and runs requests by continuous
batching, through the engine (core/engine.py) that `Model.generate` runs too.

A request waits in a FIFO queue until a row of the cache is free, then holds that row until
it ends (done, or cancelled when its client goes away) and frees it between two steps. Each
engine step decodes one token for every decoding row together and prefills waiting prompt
tokens in chunks, oldest request first, under a token budget (`chunk`, less one token per
decoding row), so a long prompt cannot stall the others. A row keeps its tokens' keys and
values after its request ends: a later prompt starts from the longest prefix any row holds
(core/slots.py). See docs/architecture.md for why the cache stays static (one row per
request) rather than paged.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import torch

from core.engine import Engine
from core.model import Model
from core.modeling import kernel_errors
from core.serve.metrics import ServerMetrics
from core.serve.seq import EmbedJob, Job, ServedSeq

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
        # the model's slots: what its rows hold is known to `generate` after the server, too
        self.engine = Engine(
            model, model.max_batch_size, chunk=CHUNK, reuse=True, slots=model.slots
        )
        cache = getattr(model.net, "kv_cache", None)
        if cache is not None:  # a row's recurrent state and its snapshots, in bytes
            self.metrics.row_bytes(cache.state_bytes, cache.snapshot_bytes)
        if getattr(model, "speculator", None) is not None:  # vLLM's spec-decode counters
            self.metrics.speculating(model.speculator)
        self.waiting: queue.SimpleQueue[Job | EmbedJob | None] = queue.SimpleQueue()
        # taken off `waiting`, not yet in a row (FIFO)
        self.pending: deque[Job | EmbedJob] = deque()
        self.queued = 0  # jobs submitted and not yet in a row
        self._count = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="zoo-scheduler", daemon=True)

    # the engine's, under the names the server and its tests read
    @property
    def running(self) -> list[ServedSeq]:
        return self.engine.running  # in admission order

    @property
    def slots(self):
        return self.engine.slots

    @property
    def chunk(self) -> int:
        return self.engine.chunk  # prompt tokens a step prefills (vLLM's max_num_batched_tokens)

    @chunk.setter
    def chunk(self, n: int) -> None:
        self.engine.chunk = n

    @property
    def reuse(self) -> bool:
        return self.engine.reuse  # start prompts from a prefix some row holds

    @reuse.setter
    def reuse(self, on: bool) -> None:
        self.engine.reuse = on

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self.waiting.put(None)
        self._thread.join(timeout=30)

    def submit(self, job: Job | EmbedJob) -> None:
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
        for seq in self.engine.clear():  # stopping: rows end as aborted, queued jobs get an error
            seq.finish = seq.finish or "abort"
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

    def _dequeue(self, job: Job | EmbedJob, running: bool) -> None:
        with self._count:
            self.queued -= 1
        self.metrics.dequeued(job.clock, running=running)

    def _admit(self) -> None:
        """Pending jobs into free rows, first come first served."""
        while self.pending and self.engine.free:
            job = self.pending.popleft()
            if job.cancelled:
                self._dequeue(job, running=False)
                job.emit("error", Cancelled("the client went away before its request ran"))
                continue
            self._dequeue(job, running=True)
            if isinstance(job, EmbedJob):
                self._embed(job)
                continue
            try:
                seq = ServedSeq(job, self.model, self.metrics)
            except Exception as err:  # e.g. a grammar that cannot be built: this job only
                log.exception("zoo: a request could not start")
                self.metrics.finished(job.clock, None)
                job.emit("error", err)
                continue
            self.engine.add(seq)
            self.metrics.prefix(len(job.ids), seq.cached)

    def _embed(self, job: EmbedJob) -> None:
        """Run an embeddings request now, between two steps, in a free row taken as a request
        takes one (holding no prefix afterwards: nothing reuses what it wrote)."""
        row, _ = self.engine.slots.acquire([], reuse=False)
        try:
            out = self.model.embed_ids(job.inputs, job.pooling, row=row)
        except Exception as err:  # this request only; the rows of the others are untouched
            log.exception("zoo: an embeddings request failed")
            job.emit("error", err)
        else:
            job.emit("done", out)
        finally:
            self.engine.slots.release(row)
            self.metrics.finished(job.clock, None)  # no tokens generated

    def _end(self, seq: ServedSeq) -> None:
        if seq.error is not None:  # it failed alone (its grammar gave out): the others go on
            self.metrics.finished(seq.job.clock, None)
            seq.job.emit("error", seq.error)
            return
        result = seq.result()
        log.debug(
            "zoo: row %d: %d prompt tokens (%d cached), %d new, %s",
            seq.row, len(seq.ids), seq.cached, len(result.token_ids), result.finish_reason,
        )  # fmt: skip
        self.metrics.finished(seq.job.clock, result)
        seq.job.emit("done", result)

    def _step(self) -> None:
        try:
            with torch.inference_mode(), kernel_errors():  # a kernel's refusal: a ZooError
                ended = self.engine.step()
        except Exception as err:  # answer every running row, keep serving
            log.exception("zoo: a step of %d requests failed", len(self.running))
            for seq in self.engine.clear():  # what the rows hold is unknown now
                self.metrics.finished(seq.job.clock, None)
                seq.job.emit("error", err)
            return
        finally:
            self.metrics.drafted()
        for seq in ended:
            self._end(seq)
