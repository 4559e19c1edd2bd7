"""One running request of the scheduler (a sequence): its row, its sampling state and the
tokens it has taken, sampled as `Model.generate` samples them (`core.generation`'s order of
checks, text, stop strings and log-probabilities), so an answer does not depend on which
other requests share its steps; and the queued request (`Job`) a Seq runs, which the scheduler
admits and the server's handlers read events from."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from core.generation import GenerationResult, _logprob_tensors, _logprobs, _Row
from core.sampling import SamplingParams, next_tokens, penalizes, sampler_groups
from core.structured import Masks, make_constraint

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


class Seq:
    """A job holding row `row` of the cache, `cached` prompt tokens of which were reused."""

    def __init__(self, job: Job, row: int, cached: int, model: Model, metrics: ServerMetrics):
        p = job.params
        self.metrics = metrics
        self.job, self.row, self.cached, self.ids = job, row, cached, job.ids
        self.params = p
        self.stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else model.eos_token_ids)
        v = model.config.vocab_size
        self.constraint = make_constraint(p, model.tokenizer, v, self.stop_ids)
        self.text = _Row(job.ids, model.tokenizer, p, self.constraint)
        dev = model.device
        self.bias = None  # logit_bias as a (V,) row
        if p.logit_bias:
            self.bias = torch.zeros(v)
            for token, b in p.logit_bias:
                self.bias[token] = b
            self.bias = self.bias.to(dev)
        self.generator = torch.Generator(dev).manual_seed(p.seed) if p.seed is not None else None
        self.last: int | None = None  # the latest token taken, fed by the next decode step
        self.t0 = time.perf_counter()
        self.t_first: float | None = None

    @property
    def decoding(self) -> bool:
        return self.last is not None

    @property
    def finish(self) -> str | None:
        return self.text.finish

    def abort(self) -> None:
        if not self.text.finish:
            self.text.finish = "abort"

    def first(self, logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor) -> None:
        """The first new token, from the prompt's last logits (1, V)."""
        Seq.sample([self], logits, counts, seen, rows_of_logits=[0])

    @staticmethod
    def sample(
        seqs: list[Seq],
        logits: torch.Tensor,
        counts: torch.Tensor,
        seen: torch.Tensor,
        rows_of_logits: list[int] | None = None,
    ) -> None:
        """One token for each of seqs from its row of logits (by default row `seq.row`)."""
        at = rows_of_logits if rows_of_logits is not None else [s.row for s in seqs]
        idx = torch.tensor(at, device=logits.device)
        cache_rows = torch.tensor([s.row for s in seqs], device=logits.device)
        x = logits[idx].float()
        ps = [s.params for s in seqs]
        pen = any(penalizes(p) for p in ps)
        c, sn = (counts[cache_rows], seen[cache_rows]) if pen else (None, None)
        chosen_from = x  # logit_bias, then grammar masks, then the sampler (as generation.run)
        if any(s.bias is not None for s in seqs):
            zero = torch.zeros_like(x[0])
            chosen_from = x + torch.stack([zero if s.bias is None else s.bias for s in seqs])
        if any(s.constraint is not None for s in seqs):
            masks = Masks([s.constraint for s in seqs], x.shape[-1])
            chosen_from = masks.apply(chosen_from, [False] * len(seqs))
        groups = sampler_groups(ps, x.device)
        gens = [s.generator for s in seqs]
        tokens = next_tokens(chosen_from, ps, groups, gens, c, sn)
        top_n = max((p.logprobs for p in ps if p.logprobs is not None), default=None)
        lps = _logprob_tensors(x, tokens, top_n) if top_n is not None else []
        host, *lps = [t.tolist() for t in (tokens, *lps)]  # the step's one wait for the device
        lps = _logprobs(*lps, host) if lps else [None] * len(seqs)
        for s, t, lp in zip(seqs, host, lps, strict=True):
            s.take(t, lp)
            if not s.finish and penalizes(s.params):  # penalties count what was generated
                counts[s.row, t] += 1
                seen[s.row, t] = True

    def take(self, token: int, lp) -> None:
        """Take one sampled token (as core.generation.run's loop does for a row)."""
        job, r = self.job, self.text
        if job.cancelled:
            r.finish = "abort"
            return
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if r.logprobs is not None:
            lp.top = dict(list(lp.top.items())[: self.params.logprobs])  # this row's top-n
            r.logprobs.append(lp)
        self.metrics.token(job.clock)
        if lp is not None and job.stream:
            job.emit("token", lp)
        piece = r.push(token, self.stop_ids, self.params.max_new_tokens)
        if piece and job.stream:
            job.emit("text", piece)
        self.last = token

    def result(self) -> GenerationResult:
        r, now = self.text, time.perf_counter()
        first = self.t_first or now
        n_decode = max(len(r.out) - 1, 0)
        return GenerationResult(
            token_ids=r.out,
            text="".join(r.text),
            finish_reason=r.finish or "length",
            prompt_tokens=len(self.ids),
            logprobs=r.logprobs,
            timings={
                "time_to_first_token_s": first - self.t0,
                "decode_tokens_per_s": n_decode / max(now - first, 1e-9),
            },
            cached_tokens=self.cached,
        )
