"""A sequence's way through the engine (core/engine.py): `Seq` holds one prompt's sampling
state and the tokens it has taken, checks each token against its stops (eos, stop token, stop
string, length, a complete grammar, or a cancel from its caller) and makes their text; its
`GenerationResult` is what callers get back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from core.errors import RequestError
from core.sampling import SamplingParams
from core.speculative import SpecStats
from core.structured import make_constraint
from core.tokenizer import StreamDecoder, Tokenizer


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model, and the top-n alternatives."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens only (a final eos / stop token included)
    text: str = ""  # their text, cut before a stop string
    finish_reason: str = "length"  # "stop" | "length" | "abort" (cancelled by the caller)
    prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    cached_tokens: int | None = None  # prompt tokens a cache row already held (not prefilled)
    # speculative decoding's drafts and acceptances for this sequence (None: it never reached
    # a speculative step: no speculation, or a first token only)
    speculation: SpecStats | None = None

    @property
    def usage(self) -> dict:
        n = len(self.token_ids)
        out = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
        }
        if self.cached_tokens is not None:  # as OpenAI's (and vLLM's) usage
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return out


class StopStrings:
    """Holds back just enough text to cut it before a stop string that may still be forming."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def feed(self, piece: str) -> tuple[str, bool]:
        """Append text; return (what is safe to emit, whether a stop string was hit)."""
        self.text += piece
        hits = [i for s in self.stops if (i := self.text.find(s, max(0, self.sent - len(s)))) >= 0]
        if hits:
            cut = min(hits)
            out, self.text, self.sent = self.text[self.sent : cut], self.text[:cut], cut
            return out, True
        safe = len(self.text) - self.hold
        if safe <= self.sent:
            return "", False
        out, self.sent = self.text[self.sent : safe], safe
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


class Seq:
    """One prompt on its way through the engine: its sampling state (logit bias, grammar,
    seeded generator), the row of the cache it holds once admitted, the tokens it has taken
    and their text. The engine calls `cancelled`, `on_token` and `on_text`; callers that
    stream or can be cancelled (the server, `Model.token_loop`) override them."""

    def __init__(
        self,
        ids: list[int],
        params: SamplingParams,
        stop_ids: set[int],
        tokenizer: Tokenizer | None,
        vocab_size: int,
        device: torch.device,
    ):
        p = self.params = params
        self.ids, self.stop_ids = ids, stop_ids
        self.constraint = make_constraint(p, tokenizer, vocab_size, stop_ids)  # or None
        self.bias = None  # logit_bias as a (V,) row
        if p.logit_bias:
            self.bias = torch.zeros(vocab_size)
            for token, b in p.logit_bias:
                self.bias[token] = b
            self.bias = self.bias.to(device)
        self.generator = torch.Generator(device).manual_seed(p.seed) if p.seed is not None else None
        self.out: list[int] = []
        self.text: list[str] = []
        self.decoder = StreamDecoder(tokenizer, p.skip_special_tokens) if tokenizer else None
        self.stops = StopStrings(p.stop)
        self.logprobs: list[TokenLogprob] | None = [] if p.logprobs is not None else None
        self.finish: str | None = None
        self.error: RequestError | None = None  # why it ended early, if it failed alone
        self.row = -1  # set by the engine on admission: the cache row it holds ...
        self.cached = 0  # ... how many prompt tokens that row already held ...
        self.pos = 0  # ... and how many positions of it hold this sequence's tokens
        self.spec: SpecStats | None = None  # its drafts' counts (speculative decoding)
        self.t0 = time.perf_counter()
        self.t_first: float | None = None

    # --- what callers may override ------------------------------------------------------------
    def cancelled(self) -> bool:
        """Asked before each step and each token: True ends the sequence ("abort")."""
        return False

    def on_token(self, token: int, logprob: TokenLogprob | None) -> None:
        """Each token as it is taken, before the text it makes."""

    def on_text(self, piece: str) -> None:
        """Each piece of text as it becomes final (cut before a stop string)."""

    # ------------------------------------------------------------------------------------------
    @property
    def decoding(self) -> bool:
        """Whether its prompt is in and its latest token waits to be fed."""
        return bool(self.out)

    def take(self, token: int, lp: TokenLogprob | None) -> None:
        """Take one sampled token (`lp`: its log-probabilities when asked for)."""
        if self.finish:
            return
        if self.cancelled():
            self.finish = "abort"
            return
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if self.logprobs is not None:
            lp.top = dict(list(lp.top.items())[: self.params.logprobs])  # this row's top-n
            self.logprobs.append(lp)
        self.on_token(token, lp)
        piece = self.push(token)
        if piece:
            self.on_text(piece)

    def push(self, token: int) -> str:
        """Append one token; return the text it makes visible."""
        self.out.append(token)
        if token in self.stop_ids:
            self.finish = "stop"
            piece = self.decoder.flush() if self.decoder else ""
        else:
            piece = self.decoder.push(token) if self.decoder else ""
            try:
                done = self.constraint is not None and self.constraint.accept(token)
            except RequestError as err:  # its grammar gave out: this row ends, with the error
                self.error, done = err, True
            if done or len(self.out) >= self.params.max_new_tokens:
                self.finish = "stop" if done else "length"  # (complete grammar: only EOS follows)
                piece += self.decoder.flush() if self.decoder else ""
        out, hit = self.stops.feed(piece)
        if hit:
            self.finish = "stop"
        elif self.finish:
            out += self.stops.flush()
        self.text.append(out)
        return out

    def result(self, timings: dict[str, float] | None = None) -> GenerationResult:
        """What it generated; `timings` by default its own (first token, decode rate).
        Raises the row's own error if it failed alone."""
        if self.error is not None:
            raise self.error
        if timings is None:
            now = time.perf_counter()
            first = self.t_first or now
            timings = {
                "time_to_first_token_s": first - self.t0,
                "decode_tokens_per_s": max(len(self.out) - 1, 0) / max(now - first, 1e-9),
            }
        return GenerationResult(
            token_ids=self.out,
            text="".join(self.text),
            finish_reason=self.finish or "length",
            prompt_tokens=len(self.ids),
            logprobs=self.logprobs,
            timings=timings,
            cached_tokens=self.cached,
            speculation=self.spec if self.spec is not None and self.spec.drafts else None,
        )


def batch_timings(seqs: list[Seq]) -> dict[str, float]:
    """A batch's timings, read now that it has ended: time to its first token (from the
    first sequence's start), prefill (of the prompt tokens no row held) and decode rates over
    all its rows."""
    t_end = time.perf_counter()
    t0 = min(s.t0 for s in seqs)
    first = min((s.t_first for s in seqs if s.t_first is not None), default=t_end)
    n_decode = sum(max(len(s.out) - 1, 0) for s in seqs)  # tokens after each row's first
    return {
        "time_to_first_token_s": first - t0,
        "prefill_tokens_per_s": sum(len(s.ids) - s.cached for s in seqs) / max(first - t0, 1e-9),
        "decode_tokens_per_s": n_decode / max(t_end - first, 1e-9),
    }
