"""Speculative sampling keeps the target's distribution (core/spec_step.py's rejection rule,
core/speculative.py `accept_draft`): many seeded draws of two tokens through a verify of two
drafts, with the target's logits fixed per position, against p1 x p2 by a chi-square test;
drafts chosen deterministically (prompt lookup: q one-hot) or drawn from a draft model's q.
The same test run on a rule that accepts every draft must fail it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import core.spec_step
from core.generation import Seq
from core.sampling import SamplingParams, filter_logits
from core.spec_step import Verifier
from core.speculative import Draft, accept_draft

V, DRAWS = 6, 6000
# chi-square with 35 degrees of freedom: P(X > 80) ~ 2e-5
CRITICAL = 80.0


class _Engine:
    """What a Verifier's acceptance reads of its engine."""

    spec = None
    model = SimpleNamespace(step=None)  # (no fused step: nothing verifies in chains)
    counts = seen = None

    def took(self, s, t, lp):
        s.take(t, lp)


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=8, temperature=0.8, ignore_eos=True, **kw)


def _draws(logits: torch.Tensor, params: SamplingParams, q: torch.Tensor | None) -> torch.Tensor:
    """Counts (V, V) of the first two tokens over DRAWS verifies of two drafts (drawn from
    q (2, V), or tokens 4 then 1 where q is None); a row that rejects at the first position
    takes its second token as the next plain step would (from position 2's logits)."""
    verifier, g = Verifier(_Engine()), torch.Generator().manual_seed(0)
    target2 = filter_logits(logits[1:2], params).softmax(dim=-1)[0]
    counts = torch.zeros(V, V)
    for _ in range(DRAWS):
        s = Seq([1], params, set(), None, V, torch.device("cpu"))
        s.generator = g
        if q is None:
            draft = Draft([4, 1])
        else:
            draft = Draft([int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)], q)
        verifier._accept(s, draft, logits)
        if len(s.out) == 1:
            s.out.append(int(torch.multinomial(target2, 1, generator=g)))
        counts[s.out[0], s.out[1]] += 1
    return counts


def _chi_square(counts: torch.Tensor, logits: torch.Tensor, params: SamplingParams) -> float:
    p = filter_logits(logits[:2], params).softmax(dim=-1)  # (2, V)
    expected = (p[0][:, None] * p[1][None, :]) * DRAWS
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the target cannot take was taken"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


LOGITS = torch.tensor(
    [[1.0, 0.2, -0.5, 0.8, 0.1, -1.0], [0.3, 1.2, -0.2, 0.0, 0.6, -0.7], [0.0] * V]
)
Q = torch.tensor([[0.1, 0.05, 0.3, 0.05, 0.4, 0.1], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]])


@pytest.mark.parametrize("proposal", ["one-hot", "draft-model"])
@pytest.mark.parametrize("top_k", [0, 4])
def test_accepted_tokens_follow_the_target(proposal, top_k):
    params = _params(top_k=top_k)
    q = Q if proposal == "draft-model" else None
    counts = _draws(LOGITS, params, q)
    # (top-k 4 leaves 16 cells: fewer degrees of freedom, the same critical value is looser)
    assert _chi_square(counts, LOGITS, params) < CRITICAL


def test_a_wrong_rule_fails(monkeypatch):
    """Accepting every draft, or replacing a rejected one from p rather than max(0, p - q),
    skews the tokens: the test above catches it."""
    params = _params()
    monkeypatch.setattr(core.spec_step, "accept_draft", lambda p, token, q, g: (True, None))
    assert _chi_square(_draws(LOGITS, params, Q), LOGITS, params) > 10 * CRITICAL
    monkeypatch.undo()

    def from_p(p, token, q, g):  # min(1, p/q), but a rejected draft replaced from p itself
        ok, _ = accept_draft(p, token, q, g)
        return ok, None if ok else p

    monkeypatch.setattr(core.spec_step, "accept_draft", from_p)
    assert _chi_square(_draws(LOGITS, params, Q), LOGITS, params) > 2 * CRITICAL
