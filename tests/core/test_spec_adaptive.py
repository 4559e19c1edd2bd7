"""The pieces of speculative decoding that need no model (core/speculative.py): prompt
lookup's matches, the learned cost of a verify, adaptive k, the settings' checks."""

from __future__ import annotations

import pytest

from core import ConfigError, load_model
from core.speculative import AdaptiveK, NgramProposer, SpecConfig, SpecStats, StepCost


class _Seq:
    def __init__(self, ids, out=()):
        self.ids, self.out = list(ids), list(out)


def test_prompt_lookup_takes_the_latest_longest_match():
    p = NgramProposer(longest=3, shortest=2)
    # "7 8" occurs twice before the end (followed by 1 2, then by 5 6); "6 7 8" once (by 5 6)
    s = _Seq([7, 8, 1, 2, 6, 7, 8, 5, 6, 9, 4], out=[6, 7, 8])
    assert p.propose(s, 2).tokens == [5, 6]
    # past the end of what it has, the copy runs on into its own drafts
    assert p.propose(s, 9).tokens == [5, 6, 9, 4, 6, 7, 8, 5, 6]
    loop = _Seq([3, 9], out=[3, 9, 3])  # a loop of two: drafts as long as asked
    assert p.propose(loop, 5).tokens == [9, 3, 9, 3, 9]
    s.out += [3]  # "8 3": never seen before
    assert p.propose(s, 2) is None
    s.out += [1]  # "3 1" unseen, and n = 1 is below `shortest`
    assert p.propose(s, 2) is None
    s.out += [2, 6]  # "1 2 6" seen once: what followed it then
    assert p.propose(s, 3).tokens == [7, 8, 5]


def test_step_cost_fits_the_verifies_it_timed():
    cost = StepCost(per_token=0.15)
    assert cost.ratio(4) == pytest.approx(1.6)  # nothing timed: the prior
    cost.plain(0.010)
    cost.verify(2, 0.012)
    assert cost.ratio(2) == pytest.approx(1.2) and cost.ratio(4) == pytest.approx(1.5)
    cost.verify(6, 0.016)
    assert cost.ratio(4) == pytest.approx(1.4)


def test_adaptive_k_follows_acceptance():
    cost = StepCost()
    cost.plain(0.01)
    for k, s in ((1, 0.011), (8, 0.018)):
        cost.verify(k, s)
    k = AdaptiveK(8, cost)
    for _ in range(20):
        k.update(8, 8)
    assert k.next() == 8  # everything accepted, cheap verifies: the longest drafts
    for _ in range(20):
        k.update(k.next() or 1, 0)
    assert k.next() == 0  # nothing accepted: plain steps


def test_one_slow_verify_does_not_price_its_k_for_good():
    cost = StepCost()
    cost.plain(1.0)
    cost.verify(8, 10.0)  # one verify of 8 drafts slowed down (a busy machine)
    k = AdaptiveK(8, cost)
    seen = []
    for _ in range(600):  # every draft accepted, a verify costs 1 + 0.1 k plain steps
        n = k.next()
        seen.append(n)
        if n:
            cost.verify(n, 1 + 0.1 * n)
            k.update(n, n)
    assert seen[-1] == 8  # back to the longest drafts


def test_probes_cost_little_when_nothing_is_accepted():
    cost = StepCost()
    cost.plain(0.01)
    cost.verify(1, 0.02)  # a verify costs two plain steps
    cost.verify(4, 0.026)
    k = AdaptiveK(8, cost)
    spent = 0.0
    for _ in range(2000):
        n = k.next()
        spent += cost.ratio(n) - 1 if n else 0.0
        if n:
            k.update(n, 0)
    assert 0 < spent / 2000 < 0.03  # it still probes, at under 3% of the time
    while not k.next():
        pass
    assert k.next() and k.next()  # a probe that drafted nothing (no update): probed again
    k.update(1, 0)
    assert not k.next()  # one that was verified waits its turn


def test_expensive_verifies_need_high_acceptance():
    cost = StepCost()
    cost.plain(0.01)
    cost.verify(1, 0.030)  # three plain steps, whatever k
    cost.verify(8, 0.031)
    k = AdaptiveK(8, cost, prior=0.5)
    assert k.next() == 0  # (1 + .5 + .25 ...) < 3
    for _ in range(30):
        k.update(8, 8)
    assert k.next() == 8


def test_stats_follow_vllm():
    s = SpecStats()
    s.add(4, 2)
    s.add(2, 2)
    assert s.accepted_per_pos == [2, 2, 0, 0]
    assert s.acceptance_rate == pytest.approx(4 / 6) and s.mean_accepted_length == 3.0


@pytest.mark.parametrize(
    "bad, words",
    [
        ("beam", "ngram, draft, mtp"),
        ({"method": "ngram", "k": 0}, "k"),
        ({"method": "ngram", "ngram_min": 5}, "ngram_min no larger than ngram_max"),
        ("draft", "needs a draft model"),
        ({"method": "ngram", "draft": "smollm2"}, "'ngram' takes no draft model"),
    ],
)
def test_bad_settings_are_refused_by_name(bad, words):
    with pytest.raises(ConfigError, match="speculative") as err:
        load_model("no-such-model-anywhere", speculative=bad)
    assert words in str(err.value)


def test_spec_config_shorthands():
    assert SpecConfig.of("ngram").method == "ngram" and SpecConfig.of(None) is None
    assert SpecConfig.of({"method": "draft", "draft": "x", "k": 3}).k == 3


def test_noisy_timings_cannot_make_refused_drafts_look_free():
    """A verify timed faster than a plain step (a busy machine) must not keep a sequence whose
    drafts are all refused drafting: a verify never counts as cheaper than a step."""
    cost = StepCost()
    cost.plain(0.040)
    cost.verify(1, 0.030)
    k = AdaptiveK(8, cost)
    drafted = 0
    for _ in range(400):
        n = k.next()
        if n:
            drafted += 1
            k.update(n, 0)
    assert drafted < 30
