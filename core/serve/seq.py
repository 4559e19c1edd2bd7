"""A queued request (`Job`), which the scheduler admits and the server's handlers read events
from, and the sequence it runs as in the engine (`ServedSeq`: core.generation's `Seq`, whose
tokens and text become the job's events)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from core.embedding import Pooling
from core.generation import Seq, TokenLogprob
from core.sampling import SamplingParams

if TYPE_CHECKING:
    from core.model import Model
    from core.serve.metrics import RequestClock, ServerMetrics


@dataclass(eq=False)
class Job:
    """One queued request: its prompt ids and parameters, and its handler's event queue."""

    ids: list[int]
    params: SamplingParams
    stream: bool  # whether the handler wants "token" / "text" events, or only the end
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # set by the handler (client gone); read before each step
    clock: RequestClock | None = None  # set by Scheduler.submit (for /metrics)

    def emit(self, kind: str, value: Any = None) -> None:
        """From the scheduler thread: ("token", TokenLogprob) | ("text", str) |
        ("done", GenerationResult) | ("error", Exception), in order."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled = True


@dataclass(eq=False)
class EmbedJob:
    """A queued embeddings request: its encoded inputs, pooled by `pooling`. The scheduler
    runs it whole in one free row between two steps and emits ("done", (N, D) tensor)."""

    inputs: list[list[int]]
    pooling: Pooling
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    clock: RequestClock | None = None
    emit = Job.emit


class ServedSeq(Seq):
    """A job's sequence in the engine: its tokens and text go to the job's handler as events,
    and to /metrics; it ends ("abort") once its handler cancels the job."""

    def __init__(self, job: Job, model: Model, metrics: ServerMetrics):
        p = job.params
        super().__init__(job.ids, p, model.stop_ids(p), model.tokenizer,
                         model.config.vocab_size, model.device)  # fmt: skip
        self.job, self.metrics = job, metrics

    def cancelled(self) -> bool:
        return self.job.cancelled

    def on_token(self, token: int, logprob: TokenLogprob | None) -> None:
        self.metrics.token(self.job.clock)
        if logprob is not None and self.job.stream:
            self.job.emit("token", logprob)

    def on_text(self, piece: str) -> None:
        if self.job.stream:
            self.job.emit("text", piece)
