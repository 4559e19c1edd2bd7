"""`GET /metrics` of `zoo serve`: Prometheus text format (prometheus_client), under vLLM's metric
names so that dashboards and alerts written for vLLM read Zoo unchanged (docs/serve.md).

Every server has its own CollectorRegistry (several servers can live in one process, as in the
tests). The scheduler thread reports a request's life: queued (`submitted`), given a row
(`dequeued`), the prompt tokens found in the prefix cache (`prefix`), each token (`token`), and
its end (`finished`), and after each step the drafts that speculative decoding made
(`drafted`); handlers report nothing.
"""

from __future__ import annotations

import copy
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from core.generation import GenerationResult
from core.speculative import Speculator

# vLLM's buckets (seconds), so that quantiles computed from them compare with vLLM's
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
_TTFT += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_TPOT += (7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
_LATENCY += (120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class RequestClock:
    """One request's timestamps (time.monotonic()), kept on its Job."""

    __slots__ = ("first", "last", "queued", "started")

    def __init__(self) -> None:
        self.queued = time.monotonic()
        self.started: float | None = None  # it was given a row
        self.first: float | None = None  # its first token
        self.last: float | None = None  # its latest token


class ServerMetrics:
    """The metrics of one server (one model, labelled model_name as vLLM's)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        reg, labels = self.registry, ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=reg).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=reg).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests holding a row.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests queued for a free row.")
        self.preemptions = counter(
            "vllm:num_preemptions", "Preempted requests (always 0: a row is held to the end)."
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found there (not prefilled again)."
        )
        self.hit_rate = gauge(
            "zoo:prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries so far."
        )
        self._queried = self._hit = 0
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self._success = Counter(
            "vllm:request_success",
            "Requests that ran to their end, by finish reason (abort: the client went away).",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "From arrival to the first token.", _TTFT
        )
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds", "Between two tokens of a request.", _TPOT
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "From arrival to the last token.", _LATENCY
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "From arrival to getting a row.", _LATENCY
        )
        self.prompt_hist = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of a finished request.", _TOKENS
        )
        self.generation_hist = histogram(
            "vllm:request_generation_tokens", "Tokens generated for a finished request.", _TOKENS
        )
        self.state_bytes = gauge(
            "zoo:recurrent_state_bytes_per_row",
            "Bytes of one cache row's recurrent state (linear-attention layers; 0: none).",
        )
        self.snapshot_bytes = gauge(
            "zoo:recurrent_snapshot_bytes_per_row",
            "Bytes of one cache row's snapshots of that state (prefix reuse; 0: none).",
        )
        self.model_name = model_name
        self.spec: SpecCounters | None = None  # (`speculating`)

    # --- from the scheduler --------------------------------------------------------------
    def submitted(self) -> RequestClock:
        """A request was queued."""
        self.waiting.inc()
        return RequestClock()

    def dequeued(self, clock: RequestClock, running: bool) -> None:
        """A request left the queue: into a row (`running`), or dropped (cancelled, shutdown)."""
        self.waiting.dec()
        if running:
            clock.started = time.monotonic()
            self.queue.observe(clock.started - clock.queued)
            self.running.inc()

    def row_bytes(self, state: int, snapshots: int) -> None:
        """What a cache row holds beside keys and values: its recurrent state and snapshots."""
        self.state_bytes.set(state)
        self.snapshot_bytes.set(snapshots)

    def speculating(self, speculator: Speculator) -> None:
        """The model decodes speculatively: vLLM's spec-decode counters, counting from now."""
        self.spec = SpecCounters(self.registry, self.model_name, speculator)

    def drafted(self) -> None:
        """A step ran: the drafts it made and what was accepted of them (when speculating)."""
        if self.spec is not None:
            self.spec.update()

    def prefix(self, prompt: int, cached: int) -> None:
        """A prompt of `prompt` tokens started from `cached` tokens a row held."""
        self.prefix_queries.inc(prompt)
        self.prefix_hits.inc(cached)
        self._queried, self._hit = self._queried + prompt, self._hit + cached
        self.hit_rate.set(self._hit / self._queried)

    def token(self, clock: RequestClock) -> None:
        """A request's next token was sampled."""
        now = time.monotonic()
        if clock.first is None:
            clock.first = now
            self.ttft.observe(now - clock.queued)
        else:
            self.tpot.observe(now - clock.last)
        clock.last = now

    def finished(self, clock: RequestClock, result: GenerationResult | None) -> None:
        """A running request ended: its result, or None when its step failed."""
        self.running.dec()
        if result is None:
            return
        prompt, generated = result.usage["prompt_tokens"], result.usage["completion_tokens"]
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self.prompt_hist.observe(prompt)
        self.generation_hist.observe(generated)
        self._success.labels(self.model_name, result.finish_reason).inc()
        self.e2e.observe(time.monotonic() - clock.queued)

    def exposition(self) -> bytes:
        """The text of GET /metrics."""
        return generate_latest(self.registry)


class SpecCounters:
    """vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py): verifying steps of a
    sequence that had drafts, tokens drafted, drafted tokens accepted, and accepted tokens by
    their position in the draft (label `position`, 0 to k - 1). They follow the speculator's
    running counts (core/speculative.py SpecStats), by what they gained since the last step;
    the acceptance rate is accepted / draft tokens, the mean accepted length 1 + accepted /
    drafts (as vLLM's docs compute them from rates)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, speculator: Speculator):
        def counter(name, doc, labels=("model_name",)):
            return Counter(name, doc, list(labels), registry=registry)

        self.speculator, self.model_name = speculator, model_name
        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self.per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ("model_name", "position"),
        )
        for c in (self.drafts, self.draft_tokens, self.accepted):
            c.labels(model_name)  # (shown at 0 before the first draft, as vLLM's)
        for pos in range(speculator.config.k):
            self.per_pos.labels(model_name, str(pos))
        self.seen = copy.deepcopy(speculator.stats)  # what the counters hold (less at start)

    def update(self) -> None:
        now, seen, name = self.speculator.stats, self.seen, self.model_name
        if now.drafts == seen.drafts:
            return
        self.drafts.labels(name).inc(now.drafts - seen.drafts)
        self.draft_tokens.labels(name).inc(now.draft_tokens - seen.draft_tokens)
        self.accepted.labels(name).inc(now.accepted_tokens - seen.accepted_tokens)
        for pos, n in enumerate(now.accepted_per_pos):
            was = seen.accepted_per_pos[pos] if pos < len(seen.accepted_per_pos) else 0
            if n > was:
                self.per_pos.labels(name, str(pos)).inc(n - was)
        self.seen = copy.deepcopy(now)
