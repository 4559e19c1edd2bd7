"""The continuous-batching scheduler on a hybrid model (Qwen3-Next: three gated-DeltaNet layers
and one attention layer): each row keeps its own recurrent state. Requests joining a busy
batch answer as `Model.generate` alone. A row's state sums up every token the row was fed, so
a later prompt resumes only after all of it (the next turn of a chat) or at a snapshot of it
inside the shared prefix (core/slots.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_checkpoint
from fixtures.recurrent import slow_decay
from test_scheduler import decoding, params, prompt, run, same_as_alone

from core import load_model
from core.serve.scheduler import Scheduler

HYBRID = dict(
    model_type="qwen3_next",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=0,  # dense MLPs: the state is what this file is about
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # a state that remembers (fixtures/recurrent.py): a leak or a wrong resume shows
    return slow_decay(make_checkpoint(tmp_path_factory.mktemp("hybrid"), HYBRID)[0])


@pytest.fixture(scope="module")
def alone(folder):
    return load_model(folder, max_seq_len=96)


@pytest.fixture
def sched(folder):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    s = Scheduler(load_model(folder, max_seq_len=96, max_batch_size=4))
    s.start()
    yield s
    s.stop()
    torch.set_num_threads(threads)


def test_rows_keep_their_own_state_and_answer_as_alone(sched, alone):
    """A long row decodes; three requests join it, one more waits for a row. Every answer is
    generate's alone: no row's state leaks into another's, a reused row starts from zeros,
    and the placeholder tokens idle rows take in a decode step never reach a running row."""
    assert sched.slots.recurrent
    sched.chunk = 4  # attention-only models prefill 4 tokens a step; this one whole prompts
    requests = [
        (prompt(20, 0), params(max_new_tokens=30)),
        (prompt(3, 1), params(max_new_tokens=5, temperature=1.0, seed=7)),
        (prompt(25, 2), params(max_new_tokens=6, logprobs=1)),
        (prompt(11, 3), params(max_new_tokens=4)),
        (prompt(9, 4), params(max_new_tokens=7)),
    ]
    order, end = [], sched._end  # the order the scheduler ends rows in (not the clients')
    sched._end = lambda seq: (order.append(seq.ids), end(seq))[1]
    results, _ = run(sched, requests, after=decoding(2))
    for (ids, p), got in zip(requests, results, strict=True):
        same_as_alone(alone, ids, p, got)
    assert order[-1] == requests[0][0]  # the long row decoded while the others came and went


def test_a_recurrent_row_resumes_after_its_history_or_at_a_snapshot(folder, alone):
    """The same prompt again starts from nothing (the row's state holds its answer too, and no
    snapshot lies inside the prompt); the next turn of that chat resumes after everything the
    row fed; a prompt diverging from it at 40 resumes at the snapshot at 32 (every 16 tokens
    here). Every answer is generate's alone; /metrics counts the hits and the snapshots' bytes."""
    model = load_model(folder, max_seq_len=96, max_batch_size=2)
    model.net.setup_caches(2, 96, snapshots=3, snapshot_interval=16)
    sched = Scheduler(model)
    sched.start()
    try:
        base, p = prompt(12, 10), params(max_new_tokens=4)
        first, again = (run(sched, [(base, p)])[0][0] for _ in range(2))
        turn = base + again.token_ids + prompt(30, 11)
        second = run(sched, [(turn, p)])[0][0]
        other = turn[:40] + prompt(5, 12)
        third = run(sched, [(other, p)])[0][0]
    finally:
        sched.stop()
    assert first.cached_tokens == again.cached_tokens == 0
    assert (second.cached_tokens, third.cached_tokens) == (len(base) + 3, 32)
    for ids, got in ((base, again), (turn, second), (other, third)):
        same_as_alone(alone, ids, p, got)
    m = sched.metrics
    assert m.prefix_hits._value.get() == len(base) + 3 + 32
    state = model.config.state_bytes_per_sequence(4)
    assert m.snapshot_bytes._value.get() == 3 * state == 3 * m.state_bytes._value.get()
