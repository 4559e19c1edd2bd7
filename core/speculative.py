"""Speculative decoding: what proposes draft tokens, how many, and how they are accepted.

The engine (core/engine.py) asks a sequence's proposer for up to k tokens that follow what it
has (`Proposer.propose`), feeds its last token and the k drafts at their positions in one
forward (a verify), and takes the target model's tokens position by position while they
agree with the drafts (greedy: the argmax; sampling: a drafted token chosen outright is kept
where the target's own draw is it, one a draft model drew passes the rejection rule of
Leviathan et al. 2023 / Chen et al. 2023, `accept_draft`; either way the tokens are
distributed exactly as the target model's). The first disagreement is replaced by the
target's own token, and a verify that accepts all k adds the target's next token too: every
verify takes 1 to k + 1 tokens. What the rejected positions wrote into the cache is rolled
back (`StaticKVCache.keep` / `rewind`).

Proposers: prompt lookup (`NgramProposer`: the tokens that followed the latest earlier
occurrence of the sequence's last n tokens), a draft model (core/spec_draft.py) and a
checkpoint's own multi-token-prediction layers (`mtp`). k adapts per sequence to how many
drafts it has been accepting (`AdaptiveK`), down to proposing nothing when they do not pay.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.errors import ConfigError

METHODS = ("ngram", "draft", "mtp")


class SpecConfig(BaseModel):
    """`load_model(..., speculative=...)`: a method name ("ngram", "mtp"), a dict of these
    fields, or a SpecConfig. `draft`: the draft model (any name `load_model` takes, or a
    loaded `Model`) for method "draft"."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    method: Literal["ngram", "draft", "mtp"]
    # most tokens drafted per step (vLLM's num_speculative_tokens); 7: a verify of 8 positions,
    # two passes of the CPU products' 4-row blocks (a 9th costs a third)
    k: int = Field(7, ge=1, le=15)
    adaptive: bool = True  # k follows each sequence's acceptance (False: always k)
    ngram_max: int = Field(4, ge=1)  # prompt lookup matches the last n tokens, n from max ...
    ngram_min: int = Field(2, ge=1)  # ... down to min (vLLM's prompt_lookup_max / _min)
    draft: Any = None  # method "draft": a name or path, or a loaded Model

    @classmethod
    def of(cls, value: Any) -> SpecConfig | None:
        """None, a method name, a dict or a SpecConfig -> a SpecConfig (None: no speculation);
        a bad value raises a ConfigError naming it."""
        if value is None or isinstance(value, SpecConfig):
            return value
        if isinstance(value, str):
            value = {"method": value}
        try:
            spec = cls.model_validate(value)
        except ValidationError as err:
            bad = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in err.errors()
            )
            raise ConfigError(
                f"speculative={value!r} is not a speculative-decoding setting ({bad}); pass "
                f"one of {', '.join(METHODS)}, or a dict such as "
                "{'method': 'draft', 'draft': 'smollm2', 'k': 4}"
            ) from None
        if spec.ngram_min > spec.ngram_max:
            raise ConfigError(
                f"speculative ngram_min ({spec.ngram_min}) exceeds ngram_max ({spec.ngram_max}); "
                "pass an ngram_min no larger than ngram_max"
            )
        if spec.method == "draft" and spec.draft is None:
            raise ConfigError(
                "speculative method 'draft' needs a draft model: pass "
                "{'method': 'draft', 'draft': NAME} (`--draft NAME` on the command line)"
            )
        if spec.method != "draft" and spec.draft is not None:
            raise ConfigError(
                f"speculative method {spec.method!r} takes no draft model (draft={spec.draft!r}): "
                "drop 'draft', or pass {'method': 'draft', 'draft': NAME} to draft with it"
            )
        return spec


class Draft(NamedTuple):
    """Proposed tokens, and the distributions they were drawn from (k, V) when sampled (None:
    chosen deterministically, as prompt lookup and greedy drafting do: q is one-hot)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Proposer:
    """Drafts tokens for sequences (core/generation.py `Seq`: `ids` the prompt, `out` the
    tokens taken, `out[-1]` not fed to the model yet, `row` its cache row, `params`)."""

    # the target model's last hidden states (before the final norm) of every position the
    # engine feeds a row are handed to `observe` (MTP layers read them)
    wants_hidden = False

    def propose(self, seq, k: int) -> Draft | None:
        """Up to k tokens to follow seq's tokens (None or no tokens: nothing this step)."""
        raise NotImplementedError

    def observe(self, seq, start: int, ids: list[int], hidden: torch.Tensor) -> None:
        """(wants_hidden) the engine fed ids at positions start.. of seq's row: hidden (T, H)."""

    def accepted(self, seq, n: int) -> None:
        """The target took the first n of the tokens last proposed for seq."""

    def release(self, seq) -> None:
        """seq ended: forget what is kept for it."""


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier place where the sequence's last n tokens occur
    (n from `longest` down to `shortest`) and propose the tokens that followed it there, the
    copy running on into its own drafts where it reaches the end (a loop repeats). Each
    sequence keeps an index of its n-grams (n-gram -> where its next token is), extended as
    tokens come, so a lookup costs a few dict reads whatever the length."""

    def __init__(self, longest: int = 4, shortest: int = 2):
        self.longest, self.shortest = longest, shortest
        self._index: dict[int, _Grams] = {}  # by id(seq)

    def propose(self, seq, k: int) -> Draft | None:
        grams = self._index.get(id(seq))
        if grams is None or grams.seq is not seq:
            grams = self._index[id(seq)] = _Grams(seq, self.longest)
        toks = grams.extend()
        for n in range(min(self.longest, len(toks) - 1), self.shortest - 1, -1):
            at = grams.after[n - 1].get(tuple(toks[-n:]))
            if at is not None:  # (the copy runs on into its own drafts: a loop of any period)
                draft = []
                for i in range(k):
                    j = at + i
                    draft.append(toks[j] if j < len(toks) else draft[j - len(toks)])
                return Draft(draft)
        return None

    def release(self, seq) -> None:
        self._index.pop(id(seq), None)


class _Grams:
    """One sequence's n-grams (n = 1..longest): where the token after each one's latest
    occurrence is, over the tokens whose next token is known."""

    def __init__(self, seq, longest: int):
        self.seq, self.tokens = seq, []
        self.after: list[dict[tuple[int, ...], int]] = [{} for _ in range(longest)]

    def extend(self) -> list[int]:
        toks, seq = self.tokens, self.seq
        new = seq.ids[len(toks) :] if len(toks) < len(seq.ids) else []
        new = new + seq.out[max(0, len(toks) - len(seq.ids)) :]
        for t in new:
            toks.append(t)
            end = len(toks) - 1  # the grams ending before this token are followed by it
            for n, index in enumerate(self.after, start=1):
                if end - n >= 0:
                    index[tuple(toks[end - n : end])] = end
        return toks


class StepCost:
    """What a verify of k drafts costs against a plain decode step, learned from the steps
    the engine times (CPUs: wall clock; elsewhere the prior): `ratio(k)` = verify time /
    plain step time, a line fitted through the recent mean time of each k seen (with one k
    seen: the prior's slope through it; none: the prior, 1 + `per_token` k)."""

    def __init__(self, per_token: float = 0.15, decay: float = 0.9, floor: float = 0.03):
        self.per_token, self.decay, self.floor = per_token, decay, floor
        self.plain_s: float | None = None  # recent mean of a plain step's seconds
        self.verify_s: dict[int, tuple[float, float]] = {}  # k -> (recent mean s, weight)

    def plain(self, seconds: float) -> None:
        d = self.decay
        self.plain_s = seconds if self.plain_s is None else d * self.plain_s + (1 - d) * seconds

    def verify(self, k: int, seconds: float) -> None:
        mean, w = self.verify_s.get(k, (seconds, 0.0))
        # the other k's age: one not timed lately is forgotten (a slow verify at a k that is
        # then never drafted again would otherwise price that k for good)
        self.verify_s = {
            j: (m, v * self.decay) for j, (m, v) in self.verify_s.items() if v * self.decay > 0.5
        }
        self.verify_s[k] = (mean + (seconds - mean) / min(w + 1, 1 / (1 - self.decay)), w + 1)

    def ratio(self, k: int) -> float:
        if self.plain_s is None or not self.verify_s:
            return 1 + self.per_token * k
        pts = [(j, m / self.plain_s, w) for j, (m, w) in self.verify_s.items()]
        total = sum(w for _, _, w in pts)
        mk = sum(j * w for j, _, w in pts) / total
        mr = sum(r * w for _, r, w in pts) / total
        var = sum(w * (j - mk) ** 2 for j, _, w in pts)
        slope = self.per_token
        if var > 0:  # (never below zero: noise must not make long drafts look free)
            slope = max(0.0, sum(w * (j - mk) * (r - mr) for j, r, w in pts) / var)
        # (a verify of k drafts does more than a plain step: never below 1 + floor k, so noise
        # in the timings cannot make drafts that are never accepted look free)
        return max(mr + slope * (k - mk), 1 + self.floor * k)


class AdaptiveK:
    """How many tokens a sequence drafts next: the k in 0..k_max that maximizes the expected
    tokens per unit of time, (1 + r1 + r1 r + ... + r1 r^(k-1)) / cost.ratio(k), against 1 for
    a plain step, with r1 the rate at which its first drafted token was accepted lately and r
    the rate of the later ones once the one before was (decaying counts, each starting at
    `prior`): drafts either refused at once or copied whole (prompt lookup on a copy) make
    long drafts pay where one rate for both would not. At k = 0 it still drafts now and then
    (a probe: the k that would pay were both rates `hopeful`), spaced so that probes cost at
    most `overhead` of the time, and twice as far apart after each probe that accepted
    nothing, so a sequence that starts repeating itself is noticed. A probe that finds
    nothing to draft (prompt lookup without a match) costs nothing and does not count: the
    next step probes again."""

    def __init__(
        self,
        k_max: int,
        cost: StepCost,
        prior: float = 0.6,
        decay: float = 0.8,
        hopeful: float = 0.8,
        overhead: float = 0.02,
        margin: float = 0.02,
    ):
        self.k_max, self.cost, self.decay = k_max, cost, decay
        # (accepted, tried) of the first drafted token, and of the later ones after an accepted
        self.first, self.later = [2 * prior, 2.0], [2 * prior, 2.0]
        self.hopeful, self.overhead, self.margin = hopeful, overhead, margin
        self.idle, self.backoff = 0, 1

    @property
    def rate(self) -> float:
        """Drafted tokens accepted lately, over all positions."""
        return (self.first[0] + self.later[0]) / (self.first[1] + self.later[1])

    def _best(self, r: float | None = None) -> tuple[int, float]:
        """(the k that maximizes tokens per unit of time, that figure; k = 0 unless drafting
        beats a plain step by `margin`), at r1 and r as lately, or both r where given."""
        r1, r = (r, r) if r is not None else (self.first[0] / self.first[1],
                                                 self.later[0] / self.later[1])  # fmt: skip
        best, best_k, gain, chance = 1.0 + self.margin, 0, 1.0, 1.0
        for k in range(1, self.k_max + 1):
            chance *= r1 if k == 1 else r
            gain += chance
            if gain / self.cost.ratio(k) > best:
                best, best_k = gain / self.cost.ratio(k), k
        return best_k, best

    def next(self) -> int:
        k, _ = self._best()
        if k:
            self.idle = 0
            return k
        k = self._best(self.hopeful)[0] or 1
        spacing = max(4.0, (self.cost.ratio(k) - 1) / self.overhead) * self.backoff
        # (`update` resets idle after a probe's verify; a probe that drafted nothing cost
        # nothing, and the next step probes again)
        self.idle += 1
        return 0 if self.idle < spacing else k

    def update(self, drafted: int, accepted: int) -> None:
        """A verify of `drafted` tokens took the first `accepted`."""
        d = self.decay
        later = min(accepted, drafted - 1)  # later tokens tried (after an accepted one) ...
        passed = max(accepted - 1, 0)  # ... and accepted
        for counts, hits, tries in ((self.first, accepted > 0, drafted > 0),
                                    (self.later, passed, later)):  # fmt: skip
            counts[0] = d * counts[0] + hits
            counts[1] = d * counts[1] + tries
        self.backoff = 1 if accepted else min(2 * self.backoff, 8)
        self.idle = 0


@dataclass
class SpecStats:
    """Counts of drafts and acceptances, as vLLM's spec-decode metrics: verifies that had
    drafts (`drafts`), tokens drafted, drafted tokens accepted, and accepted per position."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: SpecStats) -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        for i, n in enumerate(other.accepted_per_pos):
            if i < len(self.accepted_per_pos):
                self.accepted_per_pos[i] += n
            else:
                self.accepted_per_pos.append(n)

    @property
    def acceptance_rate(self) -> float:
        """Drafted tokens accepted / drafted (0 when none was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify took on average, the target's own one included (vLLM's mean
        acceptance length): 1 + accepted / drafts."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0


class Speculator:
    """A model's speculative decoding: its proposer, each running sequence's k, and the
    counts of drafts and acceptances since load (`stats`; each sequence's own: `seq.spec`)."""

    def __init__(self, config: SpecConfig, proposer: Proposer):
        self.config, self.proposer = config, proposer
        self.cost = StepCost()  # the engine times its steps into it ...
        self.timed = False  # ... where they run synchronously (CPUs): set by the engine
        self.drafting_s = 0.0  # time the proposer took this step, added to the verify's
        self.stats = SpecStats()
        self._k: dict[int, AdaptiveK] = {}  # by id(seq)

    def plan(self, seq, limit: int) -> Draft | None:
        """seq's draft for this step: at most `limit` tokens (what its max_new_tokens and the
        cache leave room for), as many as its k says; None: it decodes one token."""
        if seq.spec is None:
            seq.spec = SpecStats()
            self._k[id(seq)] = AdaptiveK(self.config.k, self.cost)
            if self.cost.plain_s is None and self.config.adaptive and self.timed:
                return None  # (a plain step first: what a verify is measured against)
        k = self._k[id(seq)].next() if self.config.adaptive else self.config.k
        k = min(k, limit)
        t0 = time.perf_counter()
        draft = self.proposer.propose(seq, k) if k > 0 else None
        self.drafting_s += time.perf_counter() - t0  # (a draft model's steps: part of a verify)
        if draft is None or not draft.tokens:
            return None
        if len(draft.tokens) > k:
            probs = None if draft.probs is None else draft.probs[:k]
            draft = Draft(draft.tokens[:k], probs)
        return draft

    def update(self, seq, drafted: int, accepted: int) -> None:
        """A verify of seq's `drafted` tokens accepted the first `accepted`."""
        if drafted:
            self.stats.add(drafted, accepted)
            seq.spec.add(drafted, accepted)
            self._k[id(seq)].update(drafted, accepted)
        self.proposer.accepted(seq, accepted)

    def release(self, seq) -> None:
        self._k.pop(id(seq), None)
        self.proposer.release(seq)


def make_speculator(config: SpecConfig | None, model, **load: Any) -> Speculator | None:
    """The Speculator for `model` (core/model.py `Model`) that `config` asks for; `load`: the
    load_model arguments a draft model is loaded with (device, dtype, cache sizes)."""
    if config is None:
        return None
    if config.method == "ngram":
        proposer: Proposer = NgramProposer(config.ngram_max, config.ngram_min)
    elif config.method == "draft":
        from core.spec_draft import DraftProposer

        proposer = DraftProposer.load(config.draft, model, **load)
    else:
        from core.spec_mtp import MTPProposer

        proposer = MTPProposer.of(model)
    return Speculator(config, proposer)


def accept_draft(
    p: torch.Tensor, token: int, q: torch.Tensor, generator: torch.Generator | None
) -> tuple[bool, torch.Tensor | None]:
    """The rejection rule for one `token` a draft model drew from q (V,), under the target's
    distribution p (V,): accept with probability min(1, p/q); else the distribution to draw
    the replacement from, max(0, p - q) normalized. Together they give tokens distributed as
    p whatever q is. (A one-hot q needs no rule: the engine keeps the draft where its own
    draw from p is that token.)"""
    pt, qt = float(p[token]), float(q[token])
    u = torch.rand((), generator=generator, device=p.device).item()
    if qt > 0 and u < min(1.0, pt / qt):
        return True, None
    rest = (p - q).clamp_(min=0)
    total = float(rest.sum())
    if not math.isfinite(total) or total <= 0:  # (p == q: no mass left; take p itself)
        return False, p
    return False, rest / total
