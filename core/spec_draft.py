"""A draft model for speculative decoding (core/speculative.py): a smaller model sharing the
target's tokenizer drafts each sequence's next k tokens, in its own cache, in the row the
sequence holds in the target's.

Each row of the draft's cache holds a prefix of its sequence's tokens (prompt + tokens taken),
recorded as `fed` (as core/slots.py records the target's rows). To draft, the tokens the row
lacks go in with one forward through the row (a whole prompt the first time, then the drafts
the target accepted and its own next token), whose last logits give the first draft; each
further draft is one decode step (the fused CPU step, where it takes a named row). A greedy row
drafts the argmax; a sampling row draws from the draft's distribution after its temperature /
top-k / top-p / min-p, with its generator, and hands those distributions to the engine, whose
rejection rule keeps the tokens distributed as the target's whatever the draft proposes.

Drafts the target rejects stay in the row past what `fed` says it holds: a full-attention layer
never reads them (they are overwritten as the row grows); a sliding layer's ring and a
recurrent state are put back (`StaticKVCache.keep` / `rewind`) once the engine says how many
were accepted, and a recurrent row is then fed the accepted ones again with its next draft.
The draft's vocabulary may be larger than the target's (its extra ids are never drafted) or
smaller (the ids both have must name the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.errors import ConfigError, ZooError
from core.kv_cache import Kept
from core.model import Model
from core.sampling import draw, filter_logits
from core.slots import shared_prefix
from core.speculative import Draft, Proposer

# Tokens a row lacks that are fed through the decode step one by one (the fused CPU step),
# more in one forward: a verify adds at most k + 1 (SpecConfig's k: at most 15).
STEPWISE = 16


@dataclass
class _Fed:
    """Drafts fed to a row past the tokens it holds (`fed`), not yet verified."""

    tokens: list[int]
    kept: Kept | None  # what they overwrote of older positions (rings, recurrent states)


class DraftProposer(Proposer):
    """Drafts by a second model (`draft`, a `Model` whose cache has at least the target's rows
    and length) for a target of `vocab_size` ids. The draft's cache rows are its own while the
    target decodes: calling the draft in between costs acceptance, never the target's tokens."""

    def __init__(self, draft: Model, vocab_size: int):
        self.draft, self.vocab_size = draft, vocab_size
        self.fed: dict[int, list[int]] = {}  # per row: the tokens the draft's row holds
        self._drafted: dict[int, _Fed] = {}  # per row: drafts fed until `accepted`

    @classmethod
    def load(
        cls, draft: Any, target: Model, *, device, dtype, max_seq_len: int, max_batch_size: int
    ) -> DraftProposer:
        """The proposer for `target`: `draft` a name or path (loaded like the target, without
        a prefix cache or speculation of its own) or a loaded `Model`. Refused (ConfigError):
        the target itself, another device, a cache too small, another tokenizer."""
        if isinstance(draft, str | Path):
            from core.api import load_model

            sizes = dict(max_seq_len=max_seq_len, max_batch_size=max_batch_size, snapshots=0)
            try:
                draft = load_model(draft, device=device, dtype=dtype, prefix_cache=False, **sizes)
            except ZooError as err:  # (said as the draft's: the target's name came first)
                raise type(err)(f"the draft model: {err}") from None
        elif not isinstance(draft, Model):
            raise ConfigError(
                f"speculative draft {draft!r} is neither a model name or path nor a loaded Model; "
                "pass {'method': 'draft', 'draft': NAME}"
            )
        else:
            _check_loaded(draft, target, max_seq_len, max_batch_size)
        _check_vocab(draft, target)
        return cls(draft, target.config.vocab_size)

    @property
    def cache(self):
        """The draft's `StaticKVCache` (read each time: `setup_caches` may replace it)."""
        return self.draft.net.kv_cache

    # --- the Proposer contract ----------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seq, k: int) -> Draft | None:
        """Up to k tokens to follow seq's prompt and tokens (the draft's ring, if any, bounds
        k: the drafts fed must not overwrite it twice)."""
        row, toks = seq.row, seq.ids + seq.out
        self._settle(row)
        if k < 1:
            return None
        self.draft.forget()  # (its own engine's rows no longer hold what they held)
        fed = self.fed.pop(row, [])  # (unknown until the drafts are in: a failure starts over)
        n = self._held(fed, toks)
        logits = self._feed(row, toks[n:], n)
        k = min(k, self.cache.kept)
        kept = self.cache.keep(row, len(toks), k - 1) if k > 1 else None
        chosen, probs = [], []
        for i in range(k):
            if i:  # the previous draft at its position: the next one's logits
                logits = self._step(row, chosen[-1], len(toks) + i - 1)
            token, q = self._choose(logits, seq)
            chosen.append(token)
            probs.append(q)
        tokens = torch.cat(chosen).tolist()  # (the one wait for the device)
        self.fed[row], self._drafted[row] = toks, _Fed(tokens[:-1], kept)
        return Draft(tokens, None if probs[0] is None else torch.stack(probs))

    def accepted(self, seq, n: int) -> None:
        """The target took n drafts: the row keeps those of them it was fed."""
        self._settle(seq.row, n)

    def release(self, seq) -> None:
        """(What the row holds is kept: a later prompt may start from it.)"""
        self._settle(seq.row)

    # --- the row -------------------------------------------------------------------------------
    def _settle(self, row: int, n: int = 0) -> None:
        """Keep the first n of the drafts last fed to row (if any); put back what the others
        overwrote. A recurrent row goes back to before all of them (refed next time)."""
        fed, drafted = self.fed.get(row), self._drafted.pop(row, None)
        if fed is None or drafted is None:
            return
        n = min(n, len(drafted.tokens))
        undo = n < len(drafted.tokens) and drafted.kept is not None
        if undo and self.cache.rewind(row, drafted.kept, n):
            return  # (a recurrent state: back to what fed says, the drafts refed next time)
        fed.extend(drafted.tokens[:n])

    def _held(self, fed: list[int], toks: list[int]) -> int:
        """How many of toks the row can resume after (its longest common prefix with fed; the
        last token is always fed, its logits give the first draft). A ring that has wrapped or
        a recurrent state cannot be cut back: anything shorter than fed starts over."""
        n = shared_prefix(fed, toks[:-1])
        wrapped = self.cache.kept < self.cache.max_seq_len and len(fed) > self.cache.kept
        if n < len(fed) and (self.cache.recurrent or wrapped):
            return 0
        return n

    def _feed(self, row: int, ids: list[int], start: int) -> torch.Tensor:
        """Feed ids at positions start.. of the draft's row: the last one's logits (V_draft,).
        A few tokens (what a verify accepted, the target's own one) go through the fused CPU
        step: as one chain where it takes one (`takes_chain`), else one by one (~10x a module
        forward's speed per token at this size); a prompt in one forward."""
        dev, step, n = self.draft.device, self.draft.step, len(ids)
        chain = getattr(step, "takes_chain", None)
        if n > 1 and chain is not None and chain(n):
            at = torch.arange(start, start + n, device=dev)
            rows = torch.full((n,), row, device=dev)
            return step(torch.tensor(ids, device=dev), at, start + n, rows=rows)[-1]
        if n == 1 or (n <= STEPWISE and step.takes_rows(1)):
            for i, t in enumerate(ids):
                logits = self._step(row, torch.tensor([t], device=dev), start + i)
            return logits
        x = torch.tensor([ids], device=dev)
        at = torch.tensor([n - 1], device=dev)
        return self.draft.net(x, start, logits_at=at, row=row)[0, -1]

    def _step(self, row: int, token: torch.Tensor, pos: int) -> torch.Tensor:
        """One token (1,) on the device at position pos of the row: its logits (V_draft,)."""
        step, dev = self.draft.step, self.draft.device
        if step.takes_rows(1):  # the fused CPU step computes just that row
            at = torch.tensor([pos], device=dev)
            return step(token, at, pos + 1, rows=torch.tensor([row], device=dev))[0]
        return self.draft.net(token[None], pos, row=row)[0, -1]

    def _choose(self, logits: torch.Tensor, seq) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft token (1,) on the device and the distribution it was drawn from (V,) over
        the target's ids (None: greedy, the argmax), from the draft's logits (V_draft,)."""
        x, v = logits.float(), self.vocab_size
        if len(x) >= v:  # ids past the target's vocabulary are never drafted
            x = x[:v]
        else:  # nor are the target's ids past the draft's
            x = torch.cat([x, x.new_full((v - len(x),), float("-inf"))])
        p = seq.params
        if p.greedy:
            return x.argmax(dim=-1, keepdim=True), None
        filtered = filter_logits(x[None], p)
        return draw(filtered, [seq.generator]), filtered.softmax(dim=-1)[0]


def _check_loaded(draft: Model, target: Model, max_seq_len: int, max_batch_size: int) -> None:
    """A loaded draft must have a cache of its own, on the target's device, with at least the
    target's rows and length (the row of a sequence is the same in both)."""
    name = str(draft.path)
    if draft is target or draft.net.kv_cache is target.net.kv_cache:
        raise ConfigError(
            f"the draft model {name} is the target model itself, whose cache rows it would "
            f"overwrite; pass its name ({{'method': 'draft', 'draft': {name!r}}}) to load a "
            "second copy with a cache of its own"
        )
    if draft.device != target.device:
        raise ConfigError(
            f"the draft model {name} is on {draft.device}, the target {target.path} on "
            f"{target.device}; load the draft with device={str(target.device)!r}"
        )
    if draft.max_batch_size < max_batch_size or draft.max_seq_len < max_seq_len:
        raise ConfigError(
            f"the draft model {name} has a KV cache of {draft.max_batch_size} rows x "
            f"{draft.max_seq_len} tokens, less than the target's {max_batch_size} x "
            f"{max_seq_len}; load it with load_model({name!r}, max_batch_size={max_batch_size}, "
            f"max_seq_len={max_seq_len}, prefix_cache=False), or pass its name"
        )


def _check_vocab(draft: Model, target: Model) -> None:
    """The draft must share the target's tokenizer: the ids both tokenizers have name the
    same tokens (a model without a tokenizer: only beside another without one)."""
    d, t = draft.tokenizer, target.tokenizer
    if d is None and t is None:
        return
    fix = "pick a draft model of the target's family that ships the same tokenizer"
    if d is None or t is None:
        lacks = draft.path if d is None else target.path
        raise ConfigError(
            f"cannot tell whether the draft model {draft.path} shares the tokenizer of "
            f"{target.path}: {lacks} has no tokenizer files; {fix}"
        )
    by_id = [{i: s for s, i in tok.vocab.items()} for tok in (d, t)]
    shared = by_id[0].keys() & by_id[1].keys()
    bad = sorted(i for i in shared if by_id[0][i] != by_id[1][i])
    if bad or not shared:
        i = bad[0] if bad else None
        which = (
            f"token id {i} is {by_id[0][i]!r} in the draft's and {by_id[1][i]!r} in the "
            f"target's ({len(bad)} of {len(shared)} shared ids differ)"
            if bad
            else "their tokenizers share no id"
        )
        raise ConfigError(
            f"the draft model {draft.path} does not share the tokenizer of {target.path}: "
            f"{which}; {fix}"
        )
