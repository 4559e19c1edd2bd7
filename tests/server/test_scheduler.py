"""The continuous-batching scheduler on its own (no HTTP): tiny random checkpoints with full
attention (Llama), a sliding window of 5 (Qwen3), a recurrent gated-DeltaNet layer beside a
full one (Qwen3.5), and the 2026 families' cache kinds: layers without a cache of their own
(Gemma 4's shared K/V), the indexer's keys and shared top-k selections (GLM-5), compressed
attention on hyper-connected streams (DeepSeek V4), chunked attention (Llama 4); batches of up
to 4 rows.

Every answer is compared with `Model.generate` of the same prompt alone, on a second copy of
the model: requests that join a busy batch, prompts prefilled in chunks of a few tokens while
other rows decode, prompts started from a prefix a row holds (its own or copied from another
row), sampled and penalized rows beside greedy ones."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from conftest import LLAMA32, make_checkpoint
from fixtures.families import DEEPSEEK_V4, GEMMA4_TEXT, GLM5, LLAMA4_SCOUT

from core import load_model
from core.embedding import Pooling
from core.sampling import SamplingParams
from core.serve.scheduler import Job, Scheduler
from core.serve.seq import EmbedJob

QWEN3_SLIDING = dict(  # tests/plugins/test_qwen3.py's: layers 1 and 2 slide over 5 positions
    model_type="qwen3",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    use_sliding_window=True,
    sliding_window=5,
    max_window_layers=1,
    bos_token_id=1,
    eos_token_id=2,
)
QWEN35_HYBRID = dict(  # tests/plugins/test_qwen3_next.py's Qwen3.5, one gated-DeltaNet layer
    model_type="qwen3_5_text",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention"],
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
)
# the 2026 families' parity models (tests/fixtures/families.py): Gemma 4's last layers read
# earlier layers' K/V (no cache of their own) beside per-layer inputs; GLM-5 caches the
# lightning indexer's keys (`index_k`) and layers 1 and 3 reuse a top-5 selection; DeepSeek V4's
# hyper-connected streams over window and compressed layers whose cache keeps every position;
# Llama 4's chunks of 4 on the roped layers and query temperature on the NoPE ones
GEMMA4_SHARED_KV = dict(GEMMA4_TEXT, model_type="gemma4_text")
DSV4_COMPRESSED = dict(DEEPSEEK_V4, model_type="deepseek_v4")
SPECS = {
    "llama": LLAMA32,
    "qwen3-sliding": QWEN3_SLIDING,
    "qwen3.5-recurrent": QWEN35_HYBRID,
    "gemma4-shared-kv": GEMMA4_SHARED_KV,
    "glm5-sparse": GLM5,
    "dsv4-compressed": DSV4_COMPRESSED,
    "llama4-chunked": LLAMA4_SCOUT,
}
RAW = {"qwen3.5-recurrent", "gemma4-shared-kv", "glm5-sparse", "dsv4-compressed"}  # see folder


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", params=list(SPECS))
def folder(request, tmp_path_factory):
    raw = request.param in RAW  # saved as transformers 5 writes it (as the hub, or its names)
    root, _ = make_checkpoint(tmp_path_factory.mktemp(request.param), SPECS[request.param], raw=raw)
    return root


@pytest.fixture(scope="module")
def alone(folder):
    return load_model(folder, max_seq_len=96)


@pytest.fixture
def sched(folder):
    s = Scheduler(load_model(folder, max_seq_len=96, max_batch_size=4))
    s.start()
    yield s
    s.stop()


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **kw})


async def _collect(job: Job):
    while True:
        kind, value = await job.events.get()
        if kind in ("done", "error"):
            return value


async def submit_all(sched, requests, after=None):
    """Submit (ids, params) requests in order; the first alone, the others once `after(sched)`
    holds (polled). Returns the results in order, and the order in which they ended."""
    loop, ended = asyncio.get_running_loop(), []
    jobs = [  # ("embed", inputs): an embeddings request (mean pooling)
        EmbedJob(p, Pooling(), loop) if ids == "embed" else Job(ids, p, stream=True, loop=loop)
        for ids, p in requests
    ]

    async def one(i, job):
        out = await _collect(job)
        ended.append(i)
        return out

    # once `after` holds, the scheduler's next step waits until the others are submitted: a
    # tiny model's row could otherwise finish before this loop sees it hold (or join)
    gate, step = threading.Event(), sched._step

    def held_step():
        if after is not None and not gate.is_set() and after(sched):
            gate.wait(30)
        step()

    sched._step = held_step
    try:
        tasks = [asyncio.create_task(one(0, jobs[0]))]
        sched.submit(jobs[0])
        deadline = time.monotonic() + 60
        while after is not None and not after(sched):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.001)
        for i, job in enumerate(jobs[1:], 1):
            sched.submit(job)
            tasks.append(asyncio.create_task(one(i, job)))
        gate.set()
        return await asyncio.gather(*tasks), ended
    finally:
        gate.set()
        sched._step = step


def run(sched, requests, after=None):
    return asyncio.run(submit_all(sched, requests, after))


def decoding(n: int):
    """Holds once the first row has taken n tokens."""
    return lambda s: bool(s.running) and len(s.running[0].out) >= n


def same_as_alone(alone, ids, p: SamplingParams, got) -> None:
    want = alone.generate(ids, **p.model_dump())
    assert got.token_ids == want.token_ids, (len(ids), p)
    assert got.finish_reason == want.finish_reason
    if p.logprobs is not None:
        assert [x.logprob for x in got.logprobs] == pytest.approx(
            [x.logprob for x in want.logprobs], abs=1e-4
        )
        assert [list(x.top) for x in got.logprobs] == [list(x.top) for x in want.logprobs]


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 96, (n,), generator=g).tolist()


def test_requests_join_a_busy_batch_and_answer_as_alone(sched, alone):
    """A long greedy row decodes; four requests arrive: three join it at once (one prompt of
    30 prefilled 4 tokens a step beside the decoding rows), the fifth waits for a free row
    (FIFO). Each answer equals Model.generate alone, and the short ones end first."""
    sched.chunk = 4
    sched.reuse = False
    requests = [
        (prompt(20, 0), params(max_new_tokens=40)),
        (prompt(3, 1), params(max_new_tokens=5, temperature=1.0, seed=7, logprobs=2)),
        (prompt(30, 2), params(max_new_tokens=6, frequency_penalty=0.5, repetition_penalty=1.3)),
        (prompt(17, 3), params(max_new_tokens=4, temperature=0.8, top_p=0.9, seed=3)),
        (prompt(9, 4), params(max_new_tokens=7, logprobs=0)),
    ]
    results, ended = run(sched, requests, after=decoding(2))
    for (ids, p), got in zip(requests, results, strict=True):
        same_as_alone(alone, ids, p, got)
        assert got.cached_tokens == 0 and got.usage["prompt_tokens_details"]["cached_tokens"] == 0
    # the 40-token row was joined, not waited for: the short rows beside it end first (the
    # fifth request, which waits for a row and then behind two prompts' chunks, may not)
    assert ended.index(0) > max(ended.index(1), ended.index(3))
    assert not sched.running and sched.queued == 0 and all(not b for b in sched.slots.busy)


def test_embeddings_between_steps_leave_running_rows_alone(folder, alone):
    """An embeddings request that arrives while a row decodes runs between two steps in the
    free row: its vectors equal Model.embed alone, the decoding row's answer equals generate's,
    and a prompt that row held before the embedding overwrote it is not reused from it."""
    sched = Scheduler(load_model(folder, max_seq_len=96, max_batch_size=2))
    sched.chunk = 4
    sched.start()
    try:
        held = (prompt(14, 5), params(max_new_tokens=3))
        run(sched, [held])  # row 0 now holds `held`'s tokens; row 1 nothing
        first = (prompt(20, 0), params(max_new_tokens=30))  # takes row 1: row 0 is left free
        texts = [prompt(n, 20 + n) for n in (9, 3, 17)]
        (got, vectors, again), ended = run(sched, [first, ("embed", texts), held], decoding(2))
    finally:
        sched.stop()
    same_as_alone(alone, *first, got)
    assert ended.index(1) < ended.index(0)  # ran while the first row was still decoding
    want = alone.embed(texts, pooling="mean", normalize=False)
    assert torch.allclose(vectors, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    same_as_alone(alone, *held, again)
    assert again.cached_tokens == 0  # row 0's keys and values are the embedding's now
    assert not sched.running and sched.queued == 0 and all(not b for b in sched.slots.busy)


def test_a_prompt_starts_from_a_prefix_a_row_holds(sched, alone):
    """The same prompt again reuses all but its last token; a prompt sharing a prefix with a
    row that is still decoding gets it copied into a free row. Answers equal generate's."""
    sliding = sched.slots.kept < sched.model.max_seq_len
    recurrent = sched.slots.recurrent  # a state of every token fed: nothing is reused
    base = prompt(4 if sliding else 24, 10)  # with a window of 5: nothing past it is reused
    p = params(max_new_tokens=1 if sliding else 6)
    first = run(sched, [(base, p)])[0][0]
    again = run(sched, [(base, p)])[0][0]
    assert first.cached_tokens == 0 and again.cached_tokens == (0 if recurrent else len(base) - 1)
    same_as_alone(alone, base, p, first)
    same_as_alone(alone, base, p, again)

    # a busy row's prefix, copied: the long row decodes while the second request arrives
    long = prompt(20, 11)
    other = long[:3] + prompt(5, 12) if sliding else long[:15] + prompt(5, 12)
    requests = [(long, params(max_new_tokens=30)), (other, params(max_new_tokens=5))]
    results, _ = run(sched, requests, after=decoding(2))
    for (ids, q), got in zip(requests, results, strict=True):
        same_as_alone(alone, ids, q, got)
    assert results[1].cached_tokens == (0 if sliding or recurrent else 15)
    hits = sched.metrics.prefix_hits._value.get()
    assert hits == again.cached_tokens + results[1].cached_tokens


def test_a_row_held_past_the_window_is_not_reused(folder, alone):
    """A sliding layer's ring keeps only a row's last `window` positions: a prompt repeated
    after a row held more than that starts from nothing (and answers as alone)."""
    s = Scheduler(load_model(folder, max_seq_len=96, max_batch_size=1))
    s.start()
    try:
        ids, p = prompt(12, 20), params(max_new_tokens=3)
        got = [run(s, [(ids, p)])[0][0] for _ in range(2)]
    finally:
        s.stop()
    for g in got:
        same_as_alone(alone, ids, p, g)
    window = SPECS.get("qwen3-sliding")["sliding_window"]
    exact = s.slots.kept > len(ids) and not s.slots.recurrent
    assert s.slots.kept in (window, 96) and got[1].cached_tokens == (len(ids) - 1 if exact else 0)


def test_cancelled_rows_end_and_free_their_row(sched):
    """A running row whose client goes away ends with "abort" at the next step; a job
    cancelled while queued never runs; then every row is free."""
    requests = [(prompt(5, 30), params(max_new_tokens=80))] * 5

    def cancel_all(s):
        if s.running and len(s.running[0].out) >= 2:
            for seq in s.running:
                seq.job.cancelled = True
            return True
        return False

    async def go():
        loop = asyncio.get_running_loop()
        jobs = [Job(ids, p, stream=False, loop=loop) for ids, p in requests]
        for job in jobs[:4]:
            sched.submit(job)
        while not cancel_all(sched):
            await asyncio.sleep(0.001)
        jobs[4].cancelled = True
        sched.submit(jobs[4])
        return await asyncio.gather(*map(_collect, jobs))

    results = asyncio.run(go())
    assert all(r.finish_reason == "abort" and len(r.token_ids) < 80 for r in results[:4])
    assert type(results[4]).__name__ == "Cancelled"
    deadline = time.monotonic() + 10
    while sched.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sched.running and sched.queued == 0 and all(not b for b in sched.slots.busy)


def test_compiled_steps_run_power_of_two_batches(sched, alone):
    """With a compiled decode step, a decode batch is padded to 1, 2 or 4 rows (each size
    compiles once); the rows added for it (free ones) change no answer. The compiled function
    is stood in for by the eager forward it would compile, recording its batch sizes."""
    sizes = []
    net = sched.model.net

    def compiled(ids, positions, end):
        sizes.append(ids.shape[0])
        return net(ids, positions, end=end)

    sched.model.step.compiled = compiled
    requests = [(prompt(6 + i, 40 + i), params(max_new_tokens=8 + 3 * i)) for i in range(3)]
    results, _ = run(sched, requests, after=decoding(1))
    for (ids, p), got in zip(requests, results, strict=True):
        same_as_alone(alone, ids, p, got)
    assert set(sizes) <= {1, 2, 4} and 4 in sizes  # three rows ran as four


def test_stopping_ends_running_rows_and_answers_queued_ones(folder):
    """On shutdown a running request ends as "abort" and a queued one gets an error."""
    s = Scheduler(load_model(folder, max_seq_len=96, max_batch_size=1))
    step = s._step

    def held_step():  # past two tokens the row waits for stop(), so it cannot finish first
        if decoding(2)(s):
            deadline = time.monotonic() + 30
            while not s._stopping and time.monotonic() < deadline:
                time.sleep(0.001)
        step()

    s._step = held_step
    s.start()

    async def go():
        loop = asyncio.get_running_loop()
        jobs = [Job(prompt(5, 50), params(max_new_tokens=90), stream=True, loop=loop)]
        jobs.append(Job(prompt(5, 51), params(max_new_tokens=5), stream=True, loop=loop))
        for job in jobs:
            s.submit(job)
        while not decoding(2)(s):
            await asyncio.sleep(0.001)
        await asyncio.to_thread(s.stop)
        return await asyncio.gather(*map(_collect, jobs))

    running, queued = asyncio.run(go())
    assert running.finish_reason == "abort" and len(running.token_ids) < 90
    assert type(queued).__name__ == "ShuttingDown"


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(sched, alone):
    """A 40-token prompt arriving while a row decodes is prefilled in chunks of the budget
    less the decoding row (8 - 1), and the decoding row takes a token after every chunk: the
    prompt never holds it up for more than one chunk."""
    calls = []
    net, step = sched.model.net, sched.model.step

    class Recorder:
        def __call__(self, ids, start, **kw):
            calls.append(ids.shape[1])  # prompt tokens of this chunk
            return net(ids, start, **kw)

        def __getattr__(self, name):
            return getattr(net, name)

    def decode(*args, **kw):
        calls.append("decode")
        return step(*args, **kw)

    decode.compiled, decode.takes_rows = None, step.takes_rows
    sched.model.net, sched.model.step, sched.chunk = Recorder(), decode, 8
    long = prompt(40, 60)
    requests = [(prompt(3, 61), params(max_new_tokens=30)), (long, params(max_new_tokens=3))]
    results, _ = run(sched, requests, after=decoding(2))
    for (ids, p), got in zip(requests, results, strict=True):
        same_as_alone(alone, ids, p, got)
    chunks = [i for i, c in enumerate(calls) if c != "decode" and c > 3]  # the long prompt's
    # (a recurrent model prefills a prompt whole: no placeholder token between its chunks)
    assert [calls[i] for i in chunks] == ([40] if sched.slots.recurrent else [7] * 5 + [5])
    assert all(calls[i + 1] == "decode" for i in chunks)
