"""The engine's speculative step (core/engine.py, core/speculative.py): each drafting row's
last token and its k drafts go through the target model in one forward (the fused CPU step
where it takes several positions of a row, else the row's own forward), then the row takes
the target's tokens position by position while they agree with the drafts: the same
processing as a plain step (logit bias, grammar mask, penalties, the row's sampler, the
target's log-probabilities), each token handed over (stop checks, text) before the next
position is looked at, so a stop ends it there. What the rejected positions wrote is rolled
back (`StaticKVCache.keep` / `rewind`; a recurrent row is fed its kept tokens again)."""

from __future__ import annotations

import time

import torch

from core.sampling import apply_penalties, draw, filter_logits, penalizes
from core.speculative import Draft, accept_draft
from core.structured import Masks
from kernels.cpu.build import MAX_ROWS


class Verifier:
    """The speculative part of an `Engine` step, for the engine's `spec` (a Speculator)."""

    def __init__(self, engine):
        self.engine, self.spec = engine, engine.spec
        # the most tokens one fused call verifies (0: each row through its own forward)
        takes = getattr(engine.model.step, "takes_chain", None)
        fits = [n for n in range(2, MAX_ROWS + 1) if takes is not None and takes(n)]
        self.chain = 0 if not fits or self.spec.proposer.wants_hidden else max(fits)

    def plan(self, seqs: list) -> dict[int, tuple]:
        """The decoding sequences that draft this step: id(seq) -> (seq, Draft). A proposer
        that reads hidden states verifies every row (no draft: its one token), so it sees
        every position."""
        cache = self.engine.model.net.kv_cache
        every = self.spec.proposer.wants_hidden
        limit_all, out = self.spec.config.k, {}
        for s in seqs:
            limit = min(
                s.params.max_new_tokens - len(s.out) - 1,  # a verify takes up to k + 1 tokens
                cache.max_seq_len - 1 - s.pos,
                cache.kept - 1,  # (k + 1 positions must fit a sliding layer's ring)
                self.chain - 1 if self.chain else limit_all,  # (one fused call per row)
            )
            draft = self.spec.plan(s, limit)
            if draft is not None or every:
                out[id(s)] = (s, draft or Draft([]))
        return out

    def run(self, drafts: dict[int, tuple]) -> None:
        """Verify every planned row; each takes its tokens."""
        eng = self.engine
        net = eng.model.net  # (keep / rewind through the net: tensor parallelism's ranks too)
        items = list(drafts.values())
        feeds = [[s.out[-1], *d.tokens] for s, d in items]
        kept = [net.keep_row(s.row, s.pos, len(f)) for (s, _), f in zip(items, feeds, strict=True)]
        t0 = time.perf_counter()
        logits = self._logits(items, feeds)
        if self.spec.timed:  # (the tokens it drafted, drafting them and verifying them)
            spent = time.perf_counter() - t0 + self.spec.drafting_s
            drafted = sum(len(d.tokens) for _, d in items)
            self.spec.cost.verify(drafted, spent)
            if not drafted:  # (rows verified without drafts, as MTP's: a plain step)
                self.spec.cost.plain(spent)
        self.spec.drafting_s = 0.0
        for (s, d), f, held, x in zip(items, feeds, kept, logits, strict=True):
            start = s.pos
            a, taken = self._accept(s, d, x)
            if held is not None and a < len(d.tokens) and net.rewind_row(s.row, held, a + 1):
                eng.forward_row(s, f[: a + 1], start)  # a recurrent state: its kept tokens again
            eng.slots.feed(s.row, f[: a + 1], eng.reuse)
            s.pos = start + a + 1
            self.spec.update(s, len(d.tokens), taken)

    def _logits(self, items: list[tuple], feeds: list[list[int]]) -> list[torch.Tensor]:
        """Each row's logits (k + 1, V) at its fed positions, in fp32."""
        from core.engine import _to_device

        eng = self.engine
        if not self.chain:
            return [
                eng.forward_row(s, f, s.pos, every=True).float()
                for (s, _), f in zip(items, feeds, strict=True)
            ]
        step, dev = eng.model.step, eng.model.device
        out, group, size = [], [], 0
        for i, f in enumerate([*feeds, None]):  # rows packed into calls of <= chain tokens
            if group and (f is None or size + len(f) > self.chain):
                pos = [items[j][0].pos + n for j in group for n in range(len(feeds[j]))]
                rows = [items[j][0].row for j in group for _ in feeds[j]]
                ids = [t for j in group for t in feeds[j]]
                x = step(_to_device(ids, dev), _to_device(pos, dev), max(pos) + 1,
                         rows=_to_device(rows, dev))  # fmt: skip
                out += x.float().split([len(feeds[j]) for j in group])
                group, size = [], 0
            if f is not None:
                group.append(i)
                size += len(f)
        return out

    def _accept(self, s, d: Draft, x: torch.Tensor) -> tuple[int, int]:
        """Hand s the target's tokens for its verified positions x (k + 1, V) while they
        agree with its drafts: (how many drafts agree, how many of them it took: fewer where
        it stopped at an earlier token)."""
        eng, p, k = self.engine, s.params, len(d.tokens)
        if p.greedy and s.constraint is None and not penalizes(p):  # all positions at once
            target = (x if s.bias is None else x + s.bias).argmax(dim=-1)
            host = target.tolist()
            a = 0
            while a < k and host[a] == d.tokens[a]:
                a += 1
            lps = self._logprobs(s, x[: a + 1], target[: a + 1])
            for i, (t, lp) in enumerate(zip(host[: a + 1], lps, strict=True)):
                eng.took(s, t, lp)
                if s.finish:  # (drafts past a stop hold right K/V, but were not taken)
                    return a, min(a, i + 1)
            return a, a
        a = 0
        for j in range(k + 1):
            q = None if d.probs is None or j >= k else d.probs[j]
            t = self._choose(s, x[j : j + 1], d.tokens[j] if j < k else None, q)
            eng.took(s, t, self._logprobs(s, x[j : j + 1], torch.tensor([t]))[0])
            if j == k or t != d.tokens[j]:
                break
            a += 1
            if s.finish:
                break
        return a, a

    def _choose(self, s, x: torch.Tensor, draft: int | None, q: torch.Tensor | None) -> int:
        """The token at one position (x: (1, V)) as a plain step would choose it, the draft
        accepted or replaced by the rejection rule where the row samples."""
        eng, p = self.engine, s.params
        if s.bias is not None:
            x = x + s.bias
        if s.constraint is not None:
            x = Masks([s.constraint], x.shape[-1]).apply(x, [False])
        if penalizes(p):
            r = slice(s.row, s.row + 1)
            x = apply_penalties(x, eng.counts[r], eng.seen[r], p)
        if p.greedy:
            return int(x.argmax())
        filtered = filter_logits(x, p)
        if draft is not None and q is not None:
            ok, rest = accept_draft(filtered.softmax(dim=-1)[0], draft, q, s.generator)
            if ok:
                return draft
            filtered = rest.log()[None]
        # a one-hot draft (prompt lookup, MTP) is taken where the plain step's own draw is
        # it: with probability p(draft), else a token of p without it, as accept_draft's rule
        # for q one-hot; and a seeded row answers as without speculation
        return int(draw(filtered, [s.generator]))

    def _logprobs(self, s, x: torch.Tensor, tokens: torch.Tensor) -> list:
        """The target's log-probabilities of tokens at positions x (n, V), where s asks."""
        if s.params.logprobs is None:
            return [None] * len(tokens)
        from core.engine import _logprob_tensors, _logprobs

        lps = _logprob_tensors(x, tokens.to(x.device), s.params.logprobs)
        return _logprobs(*(t.tolist() for t in lps), tokens.tolist())
