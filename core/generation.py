"""The token loop: prefill a batch once, then one token per row per step through the static
cache; each row samples with its own parameters and stops on its own (eos, stop token, stop
string, length, or a cancel from its caller)."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch

from core.sampling import SamplingParams, next_tokens, penalizes, sampler_groups
from core.structured import Constraint, Masks, make_constraint
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
    cached_tokens: int | None = None  # prompt tokens read from the server's prefix cache

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


class _StopStrings:
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


class _Row:
    """One prompt's progress through the loop."""

    def __init__(
        self, prompt: list[int], tok: Tokenizer | None, p: SamplingParams, c: Constraint | None
    ):
        self.prompt_len = len(prompt)
        self.constraint = c  # the grammar this row's answer follows, if any
        self.out: list[int] = []
        self.text: list[str] = []
        self.decoder = StreamDecoder(tok, p.skip_special_tokens) if tok else None
        self.stops = _StopStrings(p.stop)
        self.logprobs: list[TokenLogprob] | None = [] if p.logprobs is not None else None
        self.finish: str | None = None

    def push(self, token: int, stop_ids: set[int], max_new: int) -> str:
        """Take one token; return the text it makes visible."""
        self.out.append(token)
        if token in stop_ids:
            self.finish = "stop"
            piece = self.decoder.flush() if self.decoder else ""
        else:
            piece = self.decoder.push(token) if self.decoder else ""
            done = self.constraint is not None and self.constraint.accept(token)
            if done or len(self.out) >= max_new:  # (a complete grammar: only EOS may follow)
                self.finish = "stop" if done else "length"
                piece += self.decoder.flush() if self.decoder else ""
        out, hit = self.stops.feed(piece)
        if hit:
            self.finish = "stop"
        elif self.finish:
            out += self.stops.flush()
        self.text.append(out)
        return out


def _logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> list[torch.Tensor]:
    """[chosen tokens' log-probabilities (B,), top-n values (B, n), their ids (B, n)]."""
    lp = logits.float().log_softmax(dim=-1)
    top = lp.topk(n, dim=-1)
    return [lp.gather(-1, tokens[:, None]).squeeze(-1), top.values, top.indices]


def _logprobs(chosen: list, values: list, indices: list, tokens: list[int]) -> list[TokenLogprob]:
    return [
        TokenLogprob(t, lp, dict(zip(ids, vals, strict=True)))
        for t, lp, vals, ids in zip(tokens, chosen, values, indices, strict=True)
    ]


def _to_host(*tensors: torch.Tensor) -> Callable[[], list[list]]:
    """Start copying tensors to the host; the returned function waits for those copies only
    and gives their values as lists. On GPUs a plain `tolist()` would also wait for all work
    queued after them (a step launched ahead)."""
    if tensors[0].device.type != "cuda":
        return lambda: [t.tolist() for t in tensors]
    copies = [t.to("cpu", non_blocking=True) for t in tensors]  # into pinned memory
    done = torch.cuda.Event()
    done.record()

    def wait() -> list[list]:
        done.synchronize()
        return [t.tolist() for t in copies]

    return wait


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list on the device without waiting for the device's queued work."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":  # from pageable memory the copy would synchronize the stream
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _biases(ps: list[SamplingParams], vocab_size: int, device: torch.device):
    """(B, V) logit_bias rows, or None when no row has one."""
    if not any(p.logit_bias for p in ps):
        return None
    bias = torch.zeros(len(ps), vocab_size)
    for row, p in enumerate(ps):
        for token, b in p.logit_bias:
            bias[row, token] = b
    return bias.to(device)


def _launch(
    step: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    tokens: torch.Tensor,
    pos: torch.Tensor,
    active: torch.Tensor,
    pos_host: list[int],
    ended: list[bool],
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Feed each row's token at its next position: running rows move on by one, ended rows
    stay put, rewriting their own last slot. Returns (positions, the same on the host, logits);
    the host copy gives the step its exact `end` (max position + 1) without a sync."""
    moved = [p + (not e) for p, e in zip(pos_host, ended, strict=True)]
    pos = pos + active
    return pos, moved, step(tokens, pos, max(moved) + 1)


def run(
    forward: Callable[..., torch.Tensor],
    step: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    prompts: list[list[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    tokenizer: Tokenizer | None,
    stop_ids: set[int] | Sequence[set[int]],
    vocab_size: int,
    device: torch.device,
    cancelled: Callable[[int], bool] | None = None,
    on_token: Callable[[int, int, TokenLogprob | None], None] | None = None,
    ahead: bool = False,
) -> Generator[tuple[int, str], None, list[GenerationResult]]:
    """Yield (row, text piece) as tokens arrive; return the results.

    `forward(ids, 0, logits_at=..., lengths=...)` prefills (the model's forward); `step(tokens,
    positions, end)` feeds one token per row (a `DecodeStep`), end = every row's position + 1
    at most.
    `params` and `stop_ids` are shared by all rows or given one per row (rows sampled alike run
    together). `cancelled(row)` is asked before each of a row's tokens: True ends that row with
    finish_reason "abort" (the batch ends once every row has ended). `on_token(row, token id,
    logprob or None)` sees each token as its row takes it, before the text it makes is yielded.

    Tokens are chosen on the device; the host waits for them once per step. `ahead` (for
    devices that run asynchronously, i.e. GPUs) launches step n+1 before waiting for step n's
    tokens (copied to the host behind step n only), so the device keeps computing while the
    host runs stop checks and detokenizes. A row that ends at step n then still takes part in
    step n+1, one position on (its output dropped): within its prompt + max_new_tokens, which
    the cache holds. Outputs are the same either way.
    """
    b = len(prompts)
    ps = [params] * b if isinstance(params, SamplingParams) else list(params)
    stops = [stop_ids] * b if isinstance(stop_ids, set | frozenset) else list(stop_ids)
    lens = torch.tensor([len(x) for x in prompts], device=device)
    ids = torch.zeros(b, int(lens.max()), dtype=torch.long, device=device)  # right-padded
    for row, x in enumerate(prompts):
        ids[row, : len(x)] = torch.tensor(x, device=device)
    generators = [
        torch.Generator(device).manual_seed(p.seed) if p.seed is not None else None for p in ps
    ]
    counts = seen = None
    if any(penalizes(p) for p in ps):
        seen = torch.zeros(b, vocab_size, dtype=torch.bool, device=device)
        seen.scatter_(1, ids, True)
        seen[:, 0] = torch.tensor([0 in x for x in prompts], device=device)  # undo padding's 0
        counts = torch.zeros(b, vocab_size, device=device)
    constraints = [
        make_constraint(p, tokenizer, vocab_size, stop) for p, stop in zip(ps, stops, strict=True)
    ]
    masks = Masks(constraints, vocab_size) if any(constraints) else None
    bias = _biases(ps, vocab_size, device)
    rows = [_Row(*args) for args in zip(prompts, [tokenizer] * b, ps, constraints, strict=True)]

    def choose(logits: torch.Tensor) -> torch.Tensor:
        """The next token of every row: logit_bias and grammar masks, then its sampler."""
        if bias is not None:
            logits = logits + bias
        if masks is not None:
            logits = masks.apply(logits, ended)
        return next_tokens(logits, ps, groups, generators, counts, seen)

    top_n = max((p.logprobs for p in ps if p.logprobs is not None), default=None)

    groups = sampler_groups(ps, device)
    max_new = max(p.max_new_tokens for p in ps)
    ended = [False] * b  # the host's view of which rows have finished
    active = torch.ones(b, dtype=torch.long, device=device)  # ... and the device's, 1 = running

    t0 = time.perf_counter()
    # (B, V): the last prompt tokens; `lengths` keeps padding out of sliding layers' rings
    logits = forward(ids, 0, logits_at=lens - 1, lengths=lens)[:, 0].float()
    tokens = choose(logits)
    pos = lens - 1  # position of the token fed next, per row (B,) on the device ...
    pos_host = [len(x) - 1 for x in prompts]  # ... and on the host
    t_first = None
    for i in range(max_new):
        # the model's own log-probabilities, before penalties and filters (as vLLM's)
        lps = _logprob_tensors(logits, tokens, top_n) if top_n is not None else []
        read = _to_host(tokens, *lps)
        early = ahead and i + 1 < max_new
        if early:  # the device computes the next step while the host reads this one's tokens
            launched = _launch(step, tokens, pos, active, pos_host, ended)
        host, *lps = read()  # the loop's one wait for the device per step
        if t_first is None:
            t_first = time.perf_counter()
        lps = _logprobs(*lps, host) if lps else None
        for row, (r, p, t) in enumerate(zip(rows, ps, host, strict=True)):
            if r.finish:
                continue
            if cancelled is not None and cancelled(row):
                r.finish = "abort"
                continue
            lp = None
            if r.logprobs is not None:
                lp = lps[row]
                lp.top = dict(list(lp.top.items())[: p.logprobs])  # this row's top-n of top_n
                r.logprobs.append(lp)
            if on_token is not None:
                on_token(row, t, lp)
            piece = r.push(t, stops[row], p.max_new_tokens)
            if piece:
                yield row, piece
        now_ended = [r.finish is not None for r in rows]
        if all(now_ended):
            break  # (early, the step already launched is dropped)
        if now_ended != ended:  # a copy to the device only when a row ends
            ended = now_ended
            active = _to_device([not e for e in ended], device)
        if counts is not None:
            counts[torch.arange(b, device=device), tokens] += active
            seen[torch.arange(b, device=device), tokens] |= active.bool()
        if not early:
            launched = _launch(step, tokens, pos, active, pos_host, ended)
        pos, pos_host, logits = launched
        logits = logits.float()
        tokens = choose(logits)
    t_end = time.perf_counter()

    n_decode = sum(max(len(r.out) - 1, 0) for r in rows)  # tokens after each row's first
    timings = {
        "time_to_first_token_s": (t_first or t_end) - t0,
        "prefill_tokens_per_s": float(lens.sum()) / max((t_first or t_end) - t0, 1e-9),
        "decode_tokens_per_s": n_decode / max(t_end - (t_first or t_end), 1e-9),
    }
    return [
        GenerationResult(
            token_ids=r.out,
            text="".join(r.text),
            finish_reason=r.finish or "length",
            prompt_tokens=r.prompt_len,
            logprobs=r.logprobs,
            timings=timings,
        )
        for r in rows
    ]
