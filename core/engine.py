"""The engine: the one token loop of `Model.generate` / `Model.stream` and of `zoo serve`.

It owns the rows of the static KV cache (core/slots.py: one sequence per row), admits
sequences into free rows, and each `step()`
- decodes one token for every decoding row (the model's `DecodeStep`: the fused CPU step
  computes just those rows; otherwise rows [:k], where a row that is not decoding takes a
  placeholder token at its next position, which it has not filled yet: what it holds stays
  intact, but a recurrent state would keep it, so a busy row's state is held across the step
  and a free row's marked stale: `_placeholders`);
- then prefills: prompts that start together at rows 0..B-1 in one right-padded forward (a
  batch given to `generate` that reuses nothing: `admit`; it takes no snapshots), otherwise
  one chunk per prefilling row, oldest first, under a token budget (`chunk`, less one token
  per decoding row: the server's), a recurrent model's prompt whole (after the decode, so no
  placeholder reaches a state mid-prompt), split where its row snapshots its state when
  `reuse` (core/slots.py);
- samples every sequence that has logits in one place (`_sample`: logit bias, grammar masks,
  penalties, each row's sampler, log-probabilities), then hands each its token (`Seq.take`:
  stop checks, text).
Tokens are chosen on the device; the host waits for them once per step. `ahead` (for devices
that run asynchronously, i.e. GPUs) launches a decode-only step on the tokens still on the
device before reading them, so the device computes while the host checks stops and
detokenizes; a sequence that ends at that read took part in the launched step, its output
dropped (within its prompt + max_new_tokens, which the cache holds). Outputs are the same
either way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from core.generation import Seq, TokenLogprob
from core.parallel.distributed import world_size
from core.sampling import next_tokens, penalizes, sampler_groups
from core.slots import Slots
from core.spec_step import Verifier
from core.structured import Masks


@dataclass
class _Batch:
    """What sampling a set of sequences needs, made once while the set stays the same (an
    index tensor made per step would cost a host-to-device copy: a sync on GPUs)."""

    seqs: list[Seq]
    groups: list
    bias: torch.Tensor | None
    masks: Masks | None
    rows: torch.Tensor | slice  # their cache rows, for the penalties' counts
    top_n: int | None


@dataclass
class _Sampled:
    seqs: list[Seq]
    tokens: torch.Tensor  # (B,) on the device
    read: Callable[[], list[list]]  # waits for tokens (and log-probabilities) on the host


class Engine:
    """Rows of `model`'s cache and the sequences in them. `model` gives `net` (the forward:
    `net(ids, start_pos, logits_at=, lengths=, row=)`), `step` (a `DecodeStep`), `device`,
    `config.vocab_size`; both are read at each step. `chunk`: prompt tokens a step prefills
    (None: whole prompts); `reuse`: start prompts from a prefix some row holds; `slots`: what
    the rows hold, kept from earlier engines over the same cache (`Model.slots`; None: new)."""

    def __init__(
        self,
        model,
        rows: int,
        *,
        chunk: int | None = None,
        reuse: bool = False,
        slots: Slots | None = None,
    ):
        self.model, self.chunk, self.reuse = model, chunk, reuse
        # speculative decoding (core/speculative.py): the model's, where it was loaded with it
        self.spec = getattr(model, "speculator", None)
        self.verifier = Verifier(self) if self.spec is not None else None
        if self.spec is not None:  # (wall clock measures a step only where it is synchronous,
            # and on one rank: tensor-parallel ranks timing their own would pick their own k)
            self.spec.timed = model.device.type == "cpu" and world_size() == 1
        # (a verify reads its tokens on the host before the next step: nothing runs ahead)
        self.ahead = bool(getattr(model, "ahead", False)) and self.spec is None
        self.slots = Slots.of(model.net, rows) if slots is None else slots
        self.running: list[Seq] = []  # in admission order
        self.counts = self.seen = None  # penalties' per-row state, made when first needed
        self._pending: _Sampled | None = None  # sampled, not read yet (ahead)
        self._batch: _Batch | None = None

    # --- rows ----------------------------------------------------------------------------------
    @property
    def free(self) -> int:
        return len(self.slots.free)

    def add(self, seq: Seq, row: int | None = None) -> None:
        """Admit `seq` into a free row (from a prefix some row holds, where `reuse`), or into
        free `row` from position 0."""
        seq.row, seq.cached = self.slots.acquire(seq.ids, self.reuse, row)
        seq.pos = seq.cached
        if penalizes(seq.params):
            if self.counts is None:
                v, n, dev = self.model.config.vocab_size, len(self.slots.busy), self.model.device
                self.counts = torch.zeros(n, v, device=dev)
                self.seen = torch.zeros(n, v, dtype=torch.bool, device=dev)
            self.counts[seq.row].zero_()
            self.seen[seq.row].zero_()
            self.seen[seq.row, seq.ids] = True
        self.running.append(seq)

    def admit(self, seqs: list[Seq]) -> None:
        """Admit a batch (`Model.generate`'s): each from the longest prefix a row holds, or,
        where no row holds one for any of them, into rows 0..B-1 (free), which prefill
        together in one right-padded forward and decode as rows [:B], as on a cold cache."""
        slots = self.slots
        fresh = not any(slots.busy[: len(seqs)]) and not (
            self.reuse and any(slots.reusable(s.ids) for s in seqs)
        )
        for i, seq in enumerate(seqs):
            self.add(seq, i if fresh else None)

    def clear(self, forget: bool = True) -> list[Seq]:
        """Drop every running sequence: after a failed step (what the rows hold is unknown:
        forgotten), or between steps (`forget` False: the rows hold what was fed)."""
        dropped, self.running, self._pending, self._batch = self.running, [], None, None
        for seq in dropped:
            self._release(seq)
        if self.spec is not None:  # (a failed step's drafting is no verify's)
            self.spec.drafting_s = 0.0
        if forget:
            self.slots.forget()
        return dropped

    # --- one step ------------------------------------------------------------------------------
    def step(self) -> list[Seq]:
        """One step of every running sequence; returns those that ended (rows freed)."""
        for seq in self.running:
            if not seq.finish and seq.cancelled():
                seq.finish = "abort"
        prefilling = [s for s in self.running if s.pos < len(s.ids) and not s.finish]
        if self._pending is not None and (prefilling or not self.ahead):
            self._take(self._pending)
        if self._pending is not None:
            self._step_ahead(self._pending)
        else:  # decode first: a row prefilled now takes no placeholder before its first token
            seqs = [s for s in self.running if s.decoding and not s.finish]
            drafts = self.verifier.plan(seqs) if self.verifier is not None else {}
            seqs = [s for s in seqs if id(s) not in drafts]
            logits = None
            if seqs:
                last = _to_device([s.out[-1] for s in seqs], self.model.device)
                t0 = time.perf_counter()
                logits = self._decode(seqs, last)
                if self.spec is not None and self.spec.timed:  # (what a verify is weighed by)
                    self.spec.cost.plain(time.perf_counter() - t0)
                for s in seqs:
                    self.slots.feed(s.row, [s.out[-1]], self.reuse)
            if drafts:  # (each takes its tokens now)
                self.verifier.run(drafts)
            done, first = self._prefill(prefilling)
            seqs, logits = seqs + done, _cat(logits, first)
            if seqs:
                sampled = self._sample(seqs, logits)
                if self.ahead:
                    self._pending = sampled
                else:
                    self._take(sampled)
        ended = [s for s in self.running if s.finish]
        for seq in ended:
            self.running.remove(seq)
            self._release(seq)
        return ended

    def _release(self, seq: Seq) -> None:
        self.slots.release(seq.row)
        if self.spec is not None:
            self.spec.release(seq)

    def _step_ahead(self, last: _Sampled) -> None:
        """Decode on the tokens `last` sampled, still on the device, then read them."""
        go = [
            i
            for i, s in enumerate(last.seqs)
            if not s.finish and len(s.out) + 1 < s.params.max_new_tokens
        ]
        seqs = [last.seqs[i] for i in go]
        logits = None
        if seqs:
            tokens = last.tokens
            if len(go) < len(last.seqs):
                tokens = tokens[_to_device(go, self.model.device)]
            logits = self._decode(seqs, tokens)
        taken = [len(s.out) for s in seqs]
        self._take(last)
        for s, n in zip(seqs, taken, strict=True):  # what the rows hold, where known
            if len(s.out) > n:
                self.slots.feed(s.row, [s.out[-1]], self.reuse)
            else:  # (it took no token: what was fed is unknown)
                self.slots.fed[s.row].clear()
        live = [i for i, s in enumerate(seqs) if not s.finish]
        if live:
            keep = logits if len(live) == len(seqs) else logits[_to_device(live, logits.device)]
            self._pending = self._sample([seqs[i] for i in live], keep)

    def _prefill(self, seqs: list[Seq]) -> tuple[list[Seq], torch.Tensor | None]:
        """Prompt tokens into their rows; (the sequences whose prompt is now in, the logits of
        its last token (n, V))."""
        if not seqs:
            return [], None
        net, dev = self.model.net, self.model.device
        snapping = self.reuse and self.slots.snapshots and len(seqs) == 1  # (a batch: none)
        hidden = self.spec is not None and self.spec.proposer.wants_hidden  # (row by row)
        if self.chunk is None and not snapping and not hidden and self._together(seqs):
            ids, lens = right_padded([s.ids for s in seqs], dev)  # `lengths`: no padding in rings
            for s in seqs:
                s.pos, self.slots.fed[s.row] = len(s.ids), list(s.ids)
            return seqs, net(ids, 0, logits_at=lens - 1, lengths=lens)[:, 0]
        budget = self.chunk or math.inf
        budget -= sum(s.decoding and not s.finish for s in self.running)
        done, out = [], []
        for s in seqs:
            left = len(s.ids) - s.pos
            n = left if self.slots.recurrent else min(left, budget)
            if n <= 0:
                break
            budget -= n
            logits = self._feed(s, s.pos + n)
            if n == left:  # the prompt's last token: its logits give the first new token
                done.append(s)
                out.append(logits[:, 0])
        return done, torch.cat(out) if out else None

    def _feed(self, s: Seq, end: int) -> torch.Tensor:
        """Prompt tokens [s.pos, end) into s's row, split where the row snapshots its state
        (reuse only); the logits of the last one (1, 1, V)."""
        while s.pos < end:
            due = self.slots.due(s.row) if self.reuse else None
            stop = end if due is None else min(end, due)
            chunk = s.ids[s.pos : stop]
            logits = self.forward_row(s, chunk, s.pos)[None]
            self.slots.feed(s.row, chunk, self.reuse)
            s.pos = stop
        return logits

    def forward_row(self, s: Seq, ids: list[int], start: int, every: bool = False) -> torch.Tensor:
        """Feed ids at positions start.. of s's row: the logits of the last (1, V), or of each
        (`every`: (T, V)). A proposer that reads the target's hidden states sees them."""
        net, dev = self.model.net, self.model.device
        x = torch.tensor([ids], device=dev)
        if self.spec is not None and self.spec.proposer.wants_hidden:
            hidden = net.blocks(x, start, row=s.row)
            self.spec.proposer.observe(s, start, ids, hidden[0])
            return net.head(hidden if every else hidden[:, -1:])[0]
        at = None if every else torch.tensor([len(ids) - 1], device=dev)
        return net(x, start, logits_at=at, row=s.row)[0]

    def _together(self, seqs: list[Seq]) -> bool:
        """Whether seqs are whole fresh prompts in rows 0..B-1 and nothing else runs."""
        return len(seqs) == len(self.running) and all(
            s.row == i and s.pos == 0 for i, s in enumerate(seqs)
        )

    def _decode(self, seqs: list[Seq], tokens: torch.Tensor) -> torch.Tensor:
        """Feed each sequence's token (`tokens`, on the device, in seqs' order) at its next
        position: logits (len(seqs), V) in that order."""
        step, dev, fed = self.model.step, self.model.device, self.slots.fed
        takes_rows = getattr(step, "takes_rows", None)
        pos = [s.pos for s in seqs]
        for s in seqs:
            s.pos += 1
        if takes_rows is not None and takes_rows(len(seqs)):
            rows = _to_device([s.row for s in seqs], dev)
            return step(tokens, _to_device(pos, dev), max(pos) + 1, rows=rows)
        k = max(s.row for s in seqs) + 1
        if getattr(step, "compiled", None) is not None:  # a few batch sizes to compile: 2^n
            k = min(1 << (k - 1).bit_length(), len(fed))
        at = [len(fed[r]) for r in range(k)]  # a placeholder's: the row's next position
        for s, p in zip(seqs, pos, strict=True):
            at[s.row] = p
        order = [s.row for s in seqs]
        held = self._placeholders(set(range(k)) - set(order))
        if order == list(range(k)):
            out = step(tokens, _to_device(at, dev), max(at) + 1)
        else:
            idx = _to_device(order, dev)
            full = torch.zeros(k, dtype=torch.long, device=dev).index_copy_(0, idx, tokens)
            out = step(full, _to_device(at, dev), max(at) + 1)[idx]
        for r, state in held:
            self.model.net.kv_cache.put(r, state)
        return out

    def _placeholders(self, rows: set[int]) -> list[tuple[int, list[torch.Tensor]]]:
        """Rows about to take a decode step's placeholder: a recurrent state would keep it. A
        busy row's (a prompt about to resume from it) is held, to be put back; a free row's is
        no longer that of what it fed (Slots.touched: its snapshots still are)."""
        if not self.slots.recurrent:
            return []
        for r in rows:
            if not self.slots.busy[r]:
                self.slots.touched(r)
        cache = self.model.net.kv_cache
        return [
            (r, cache.hold(r)) for r in sorted(rows) if self.slots.busy[r] and self.slots.fed[r]
        ]

    # --- sampling: the one place -----------------------------------------------------------
    def _batch_of(self, seqs: list[Seq]) -> _Batch:
        b = self._batch
        same = b is not None and len(b.seqs) == len(seqs)
        if same and all(a is s for a, s in zip(b.seqs, seqs, strict=True)):
            return b
        dev, ps = self.model.device, [s.params for s in seqs]
        bias = None
        if any(s.bias is not None for s in seqs):
            zero = torch.zeros(self.model.config.vocab_size, device=dev)
            bias = torch.stack([zero if s.bias is None else s.bias for s in seqs])
        masks = None
        if any(s.constraint is not None for s in seqs):
            masks = Masks([s.constraint for s in seqs], self.model.config.vocab_size)
        at = [s.row for s in seqs]
        rows = slice(0, len(at)) if at == list(range(len(at))) else _to_device(at, dev)
        top_n = max((p.logprobs for p in ps if p.logprobs is not None), default=None)
        self._batch = _Batch(seqs, sampler_groups(ps, dev), bias, masks, rows, top_n)
        return self._batch

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> _Sampled:
        """One token per sequence from its logits (n, V): logit bias, then grammar masks, then
        its penalties and sampler; log-probabilities are the model's own (as vLLM's)."""
        b = self._batch_of(seqs)
        x = logits.float()
        chosen = x if b.bias is None else x + b.bias
        if b.masks is not None:
            chosen = b.masks.apply(chosen, [False] * len(seqs))
        ps = [s.params for s in seqs]
        pen = self.counts is not None and any(penalizes(p) for p in ps)
        counts, seen = (self.counts[b.rows], self.seen[b.rows]) if pen else (None, None)
        gens = [s.generator for s in seqs]
        tokens = next_tokens(chosen, ps, b.groups, gens, counts, seen)
        lps = _logprob_tensors(x, tokens, b.top_n) if b.top_n is not None else []
        return _Sampled(seqs, tokens, _to_host(tokens, *lps))

    def _take(self, sampled: _Sampled) -> None:
        """Read sampled tokens on the host and hand each to its sequence."""
        self._pending = None
        host, *lps = sampled.read()  # the step's one wait for the device
        lps = _logprobs(*lps, host) if lps else [None] * len(host)
        for s, t, lp in zip(sampled.seqs, host, lps, strict=True):
            self.took(s, t, lp)

    def took(self, s: Seq, t: int, lp: TokenLogprob | None) -> None:
        """Hand s its token t; its penalties count what was generated."""
        s.take(t, lp)
        if not s.finish and penalizes(s.params):
            self.counts[s.row, t] += 1
            self.seen[s.row, t] = True


def right_padded(ids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists as one right-padded (B, T) batch, and each one's length (B,)."""
    lens = torch.tensor([len(x) for x in ids], device=device)
    batch = torch.zeros(len(ids), int(lens.max()), dtype=torch.long)
    for i, x in enumerate(ids):
        batch[i, : len(x)] = torch.tensor(x)
    return batch.to(device), lens


def _cat(*parts: torch.Tensor | None) -> torch.Tensor | None:
    parts = [p for p in parts if p is not None]
    return parts[0] if len(parts) == 1 else torch.cat(parts) if parts else None


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
