"""The scheduler thread of `zoo serve`: it owns the model and runs queued requests in waves.

A wave is what waits in the queue when the model is free (up to the KV cache's max_batch_size,
gathered for GATHER_S after the first): one batch through the static cache, each row with its
own sampling parameters. Requests that arrive during a wave wait for the next one; a row whose
client disconnects is cancelled and stops at the next step, so its wave ends sooner.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from core.generation import GenerationResult, TokenLogprob
from core.model import Model
from core.sampling import SamplingParams
from core.server_metrics import RequestClock, ServerMetrics

log = logging.getLogger("zoo.server")
GATHER_S = 0.005  # once a request waits, how long others may take to join its wave


class ShuttingDown(Exception):
    """Handed to requests still queued when the server stops."""


class QueueFull(Exception):
    """A request that found `max_queue` requests already waiting (the server answers 503)."""


class Cancelled(Exception):
    """Handed to a request cancelled while it waited in the queue (it never runs)."""


@dataclass(eq=False)
class Job:
    """One queued request: its prompt ids and parameters, and its handler's event queue."""

    ids: list[int]
    params: SamplingParams
    stream: bool  # whether the handler wants "token" / "text" events, or only the end
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # set by the handler (client gone); read by the token loop
    clock: RequestClock | None = None  # set by Scheduler.submit (for /metrics)

    def emit(self, kind: str, value: Any = None) -> None:
        """From the scheduler thread: ("token", TokenLogprob) | ("text", str) |
        ("done", GenerationResult) | ("error", Exception), in order."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled = True


class Scheduler:
    """The thread that owns the model and runs queued jobs in waves of up to max_batch_size."""

    def __init__(
        self, model: Model, metrics: ServerMetrics | None = None, max_queue: int | None = None
    ):
        self.model = model
        self.metrics = metrics or ServerMetrics("")
        self.max_batch_size = model.max_batch_size
        self.max_queue = max_queue  # None: unbounded
        self.waiting: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.queued = 0  # jobs submitted and not yet taken into a wave
        self._count = threading.Lock()
        self.running: list[Job] = []
        self._thread = threading.Thread(target=self._serve, name="zoo-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        for job in self.running:
            job.cancelled = True
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

    def _next_wave(self) -> list[Job] | None:
        """Block for one job, then take whatever else arrives within GATHER_S; None: stop."""
        wave = [self.waiting.get()]
        deadline = time.monotonic() + GATHER_S
        while wave[-1] is not None and len(wave) < self.max_batch_size:
            try:
                wave.append(self.waiting.get(timeout=max(deadline - time.monotonic(), 0)))
            except queue.Empty:
                break
        with self._count:
            self.queued -= len(wave) - (wave[-1] is None)
        if wave[-1] is None:
            for job in wave[:-1]:
                self.metrics.dequeued(job.clock, running=False)
                job.emit("error", ShuttingDown("the server is shutting down"))
            return None
        for job in wave:
            self.metrics.dequeued(job.clock, running=not job.cancelled)
            if job.cancelled:
                job.emit("error", Cancelled("the client went away before its request ran"))
        return [job for job in wave if not job.cancelled]

    def _serve(self) -> None:
        while (wave := self._next_wave()) is not None:
            if wave:
                self._run(wave)

    def _run(self, wave: list[Job]) -> None:
        def on_token(row: int, token: int, logprob: TokenLogprob | None) -> None:
            self.metrics.token(wave[row].clock)
            if logprob is not None and wave[row].stream:
                wave[row].emit("token", logprob)

        self.running = wave
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                loop = self.model.token_loop(
                    [job.ids for job in wave],
                    [job.params for job in wave],
                    cancelled=lambda row: wave[row].cancelled,
                    on_token=on_token,
                )
                while True:
                    try:
                        row, piece = next(loop)
                    except StopIteration as done:
                        results: list[GenerationResult] = done.value
                        break
                    if wave[row].stream:
                        wave[row].emit("text", piece)
            for job, result in zip(wave, results, strict=True):
                self.metrics.finished(job.clock, result)
                job.emit("done", result)
            n = sum(len(r.token_ids) for r in results)
            log.debug(
                "zoo: batch of %d: %d tokens in %.2fs", len(wave), n, time.perf_counter() - t0
            )
        except Exception as err:  # answer every row of the batch, keep serving
            log.exception("zoo: a batch of %d requests failed", len(wave))
            for job in wave:
                self.metrics.finished(job.clock, None)
                job.emit("error", err)
        finally:
            self.running = []
