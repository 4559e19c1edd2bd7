"""Drafting with the checkpoint's own multi-token-prediction layer (core/mtp.py):
load_model(..., speculative="mtp").

The MTP layer at position i reads the target's last-layer output h_i and the token t_{i+1},
and predicts t_{i+2}. The engine hands the proposer the target's h of every position it feeds
a row (`observe`: prompt chunks, verifies), and says how many of a verify's positions were
kept (`accepted`). Each row's h are held until its next `propose`, when the tokens after them
are known: one forward of the MTP layer over those positions fills its cache (a per-position
cache, one row per engine row) up to the row's last fed position, pos - 1, whose output drafts
the token after seq.out[-1] (greedy: the argmax, so the engine's rejection rule is exact when
sampling too). Each further draft runs the one layer again at the next position, on the
layer's own last output (standing in for the target's h) and the token just drafted, as vLLM
does past num_nextn_predict_layers; those positions are overwritten by the real ones later.

A prompt started from a prefix a row already holds (prefix caching) was not fed, so its h are
unknown: the MTP cache keeps what it holds there, which is the same prefix's where the row's
earlier sequence (or the row it was copied from: `CausalLM.copy_rows` copies both caches)
ran the MTP over it; its last position, or positions that sequence never drafted from, are
stale. Stale entries cost acceptance, never tokens: the target verifies every draft.
"""

from __future__ import annotations

import torch

from core.errors import ConfigError
from core.speculative import Draft, Proposer


class MTPProposer(Proposer):
    """Drafts with `net.mtp` (an MTPNetwork) for the rows of `net` (a CausalLM)."""

    wants_hidden = True

    def __init__(self, net):
        self.net = net
        self._held: dict[int, _Held] = {}  # by id(seq)

    @classmethod
    def of(cls, model) -> MTPProposer:
        """The proposer of `model` (core/model.py `Model`), loaded with its MTP layer."""
        if model.net.mtp is None:
            raise ConfigError(
                f"{model.path}: loaded without its MTP layer; load it with "
                "load_model(..., speculative='mtp')"
            )
        return cls(model.net)

    def observe(self, seq, start: int, ids: list[int], hidden: torch.Tensor) -> None:
        held = self._held.get(id(seq))
        if held is None or held.seq is not seq or not held.start <= start <= held.end:
            held = self._held[id(seq)] = _Held(seq, start, hidden[:0])
        held.hidden = torch.cat([held.hidden[: start - held.start], hidden])  # replaces a re-feed
        held.last = start

    def accepted(self, seq, n: int) -> None:
        held = self._held.get(id(seq))
        if held is not None and held.seq is seq:  # positions past last + n were rejected
            held.hidden = held.hidden[: held.last + n + 1 - held.start]

    def propose(self, seq, k: int) -> Draft | None:
        held = self._held.get(id(seq))
        if held is None or held.seq is not seq or held.end != seq.pos or held.end == held.start:
            return None  # (no h of the row's last position)
        toks = seq.ids + seq.out  # toks[i] at position i; toks[pos] = out[-1], not fed yet
        y, logits = self.run(seq.row, toks[held.start + 1 : seq.pos + 1], held.hidden, held.start)
        held.start, held.hidden = seq.pos, held.hidden[:0]
        drafts = [int(logits[-1].argmax())]
        for j in range(1, k):  # the one layer again, on its own output and the last draft
            y, logits = self.run(seq.row, drafts[-1:], y[-1:], seq.pos + j - 1)
            drafts.append(int(logits[-1].argmax()))
        return Draft(drafts)

    def run(self, row: int, tokens: list[int], hidden: torch.Tensor, start: int):
        """The MTP layer over positions start.. of cache `row`, from the tokens t_{i+1} and
        hidden states h_i (T, H): (its outputs y (T, H), logits (T, V) of t_{i+2})."""
        net = self.net
        ids = torch.tensor([tokens], device=hidden.device)
        y = net.mtp(net.model.embed_tokens(ids), hidden[None], start, row)[0]
        return y, net.scale_logits(net.lm_head(net.mtp.layer.shared_head.norm(y)))

    def release(self, seq) -> None:
        self._held.pop(id(seq), None)


class _Held:
    """A sequence's target hidden states not yet run through the MTP layer: h of positions
    start..end - 1 (`hidden`, (end - start, H)); `last`: where the latest observe started."""

    def __init__(self, seq, start: int, hidden: torch.Tensor):
        self.seq, self.start, self.hidden, self.last = seq, start, hidden, start

    @property
    def end(self) -> int:
        return self.start + len(self.hidden)
