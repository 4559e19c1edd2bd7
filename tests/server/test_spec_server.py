"""`zoo serve` on a model loaded with speculative decoding (prompt lookup, `speculative="ngram"`):
a batch of rows where some draft and others cannot answers token for token as the same
scheduler without speculation, and /metrics carries vLLM's spec-decode counters."""

from __future__ import annotations

import pytest
from test_limits_metrics import complete, scrape
from test_scheduler import decoding, params, prompt, run
from test_server import Server, folder  # noqa: F401  (folder: a fixture)

from core import load_model
from core.serve.app import create_app
from core.serve.metrics import ServerMetrics
from core.serve.scheduler import Scheduler

SIZES = dict(max_seq_len=96, max_batch_size=4)


pytestmark = pytest.mark.usefixtures("drafts_k_max")


@pytest.fixture(scope="module")
def served(folder):  # noqa: F811
    model = load_model(folder, speculative="ngram", **SIZES)
    model.generate([5, 6, 5, 6], max_new_tokens=4)  # (builds the C step here, not in a request)
    srv = Server(create_app(model, "tiny"))
    srv.model = model
    yield srv
    srv.close()


def answers(folder, requests, **load):  # noqa: F811
    """The results of `requests` on a scheduler of its own: the first one decodes before the
    others join it, so that all run in one batch."""
    model = load_model(folder, **SIZES, **load)
    sched = Scheduler(model)
    sched.reuse = False
    sched.start()
    try:
        return run(sched, requests, after=decoding(3))[0], model
    finally:
        sched.stop()


def test_drafting_rows_beside_plain_ones_answer_as_without_speculation(folder):  # noqa: F811
    """Rows whose prompts repeat themselves draft; a max_tokens=1 row and a prompt without
    repeats (drafting little or nothing) decode beside them, one row penalized and asking
    for log-probabilities. Every answer equals the same scheduler's without speculation."""
    loop = prompt(6, 1) * 4  # (the tiny model's greedy answers repeat themselves too)
    requests = [
        (loop, params(max_new_tokens=40)),
        (prompt(5, 2) * 3, params(max_new_tokens=24, logprobs=2, repetition_penalty=1.3)),
        (prompt(9, 3), params(max_new_tokens=1)),
        (list(range(40, 62)), params(max_new_tokens=16)),
    ]
    want, _ = answers(folder, requests)
    got, model = answers(folder, requests, speculative="ngram")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason, i
        if w.logprobs is not None:
            assert [x.logprob for x in g.logprobs] == pytest.approx(
                [x.logprob for x in w.logprobs], abs=1e-4
            )
            assert [list(x.top) for x in g.logprobs] == [list(x.top) for x in w.logprobs]
    assert got[0].speculation.accepted_tokens > 0  # it did draft, and was taken at its word
    assert got[2].speculation is None  # one token: nothing to draft
    stats = model.speculator.stats
    assert stats.drafts == sum(r.speculation.drafts for r in got if r.speculation)


def test_metrics_count_the_drafts_as_vllm_names_them(served):
    """After a request, the four counters moved by what the model's speculator counted, once:
    per position, accepted tokens only fall from one position to the next and add up to the
    accepted total; positions 0..k-1 are there from the start."""
    before = scrape(served)
    stats = served.model.speculator.stats
    counted = (stats.drafts, stats.draft_tokens, stats.accepted_tokens)
    status, body = complete(served, prompt(6, 4) * 4, 30)
    assert status == 200 and body["usage"]["completion_tokens"] == 30
    after = scrape(served)

    def moved(name: str) -> float:
        return after[f"vllm:spec_decode_{name}_total"] - before[f"vllm:spec_decode_{name}_total"]

    drafts = moved("num_drafts")
    assert drafts == stats.drafts - counted[0] > 0
    assert moved("num_draft_tokens") == stats.draft_tokens - counted[1]
    accepted = moved("num_accepted_tokens")
    assert accepted == stats.accepted_tokens - counted[2] > 0
    k = served.model.speculator.config.k
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total{position=%d}"
    per_pos = [after[name % i] - before[name % i] for i in range(k)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert not any(key.startswith("vllm:spec_decode") and f"position={k}" in key for key in after)
    assert b"spec_decode" not in ServerMetrics("tiny").exposition()  # (without: none, as vLLM)
