"""`zoo serve`'s context limits and its Prometheus `/metrics`, through HTTP on 127.0.0.1: the tiny
random Llama of test_server.py with a 32-token context, each test on servers of its own."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import IDLE, Server, folder  # noqa: F401  (folder: a fixture)

from core import load_model
from core.serve.app import create_app

CONTEXT = 32


@pytest.fixture
def server(folder):  # noqa: F811
    srv = Server(create_app(load_model(folder, max_seq_len=CONTEXT, max_batch_size=2), "tiny"))
    yield srv
    srv.close()


def complete(server: Server, ids: list[int], max_tokens: int | None, **kw):
    body = {"model": "tiny", "prompt": ids, "temperature": 0, "ignore_eos": True, **kw}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return server.raw("POST", "/v1/completions", json.dumps(body), key=None)


# --- limits -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [CONTEXT, CONTEXT + 9])
def test_prompt_longer_than_the_context_is_400_naming_both_lengths(server, n):
    status, body = complete(server, list(range(1, n + 1)), 1)
    assert status == 400, body
    err = body["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] is None
    assert f"prompt ({n} tokens)" in err["message"]
    assert f"context length ({CONTEXT} tokens)" in err["message"]


def test_max_tokens_beyond_the_room_is_400_as_vllm(server):
    status, body = complete(server, list(range(1, 11)), CONTEXT - 9)
    assert status == 400, body
    err = body["error"]
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    message = err["message"]
    assert "prompt (10 tokens)" in message and f"max_tokens ({CONTEXT - 9})" in message
    assert f"({CONTEXT} tokens)" in message and f"{CONTEXT - 10} tokens are left" in message


@pytest.mark.parametrize("max_tokens", [CONTEXT - 10, None])
def test_the_answer_fills_the_room_exactly_and_never_overruns(server, max_tokens):
    """max_tokens == the room (or none: the rest of the context) runs to the last position."""
    status, body = complete(server, list(range(1, 11)), max_tokens)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == CONTEXT - 10
    assert body["choices"][0]["finish_reason"] == "length"
    assert server.raw("GET", "/health", key=None) == (200, IDLE)


# --- /metrics ---------------------------------------------------------------------------------
def scrape(server: Server) -> dict[str, float]:
    """{sample name{labels but model_name}: value} of GET /metrics."""
    import http.client

    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=30)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/plain")
    text = resp.read().decode()
    conn.close()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.pop("model_name") == "tiny"
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_metrics_count_every_request_and_token(server, folder):  # noqa: F811
    # a second server in the same process: each has its own registry (no duplicate names)
    other = Server(create_app(load_model(folder, max_seq_len=CONTEXT), "tiny"))
    try:
        assert scrape(other)["vllm:prompt_tokens_total"] == 0
    finally:
        other.close()
    before = scrape(server)
    asks = [(5, 3), (7, 1), (12, 6)]  # (prompt tokens, max_tokens), eos ignored
    for n, m in asks:
        status, body = complete(server, list(range(1, n + 1)), m)
        assert status == 200 and body["usage"]["completion_tokens"] == m
    assert complete(server, list(range(1, 40)), 1)[0] == 400  # refused: counted nowhere
    after = scrape(server)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("vllm:prompt_tokens_total") == sum(n for n, _ in asks)
    assert moved("vllm:generation_tokens_total") == sum(m for _, m in asks)
    assert moved("vllm:request_success_total{finished_reason=length}") == len(asks)
    for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert moved(f"vllm:{hist}_seconds_count") == len(asks), hist
    # one gap between two tokens of a request per token after its first
    assert moved("vllm:time_per_output_token_seconds_count") == sum(m - 1 for _, m in asks)
    assert moved("vllm:request_generation_tokens_sum") == sum(m for _, m in asks)
    assert moved("vllm:request_prompt_tokens_count") == len(asks)
    assert after["vllm:time_to_first_token_seconds_sum"] > 0
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:num_preemptions_total"] == 0


def test_a_repeated_prompt_reports_its_cached_tokens(server):
    """The same prompt again starts from the row that held it: usage says how many prompt
    tokens were not prefilled again (all but the last), the answer is the same, and /metrics
    counts the lookups and hits."""
    ids = list(range(40, 60))
    first, again = (complete(server, ids, 4)[1] for _ in range(2))
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": len(ids) - 1}
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    after = scrape(server)
    assert after["vllm:prefix_cache_queries_total"] == 2 * len(ids)
    assert after["vllm:prefix_cache_hits_total"] == len(ids) - 1
    assert after["zoo:prefix_cache_hit_rate"] == pytest.approx((len(ids) - 1) / (2 * len(ids)))
    # an attention-only model: no recurrent state, no snapshots of it
    assert after["zoo:recurrent_state_bytes_per_row"] == 0
    assert after["zoo:recurrent_snapshot_bytes_per_row"] == 0


# --- the bounded queue (--max-queue) ---------------------------------------------------------
def test_a_full_queue_is_503_with_retry_after(folder):  # noqa: F811
    """max_queue=0: no request may wait, so every one is turned away at once (the counting
    itself is the next test's)."""
    import http.client

    srv = Server(create_app(load_model(folder, max_seq_len=CONTEXT), "tiny", max_queue=0))
    try:
        conn = http.client.HTTPConnection(srv.url.removeprefix("http://"), timeout=30)
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        err = json.loads(resp.read())["error"]
        conn.close()
        assert resp.status == 503 and resp.getheader("Retry-After") == "1"
        assert "already waiting" in err["message"] and "--max-queue" in err["message"]
        assert srv.raw("GET", "/health", key=None) == (200, IDLE)
    finally:
        srv.close()


def test_the_queue_counts_what_waits_and_frees_what_a_row_takes(folder):  # noqa: F811
    """FIFO with a bound: the second of max_queue=1 is refused while the first waits; once a
    row has taken the first, the next one is let in."""
    import asyncio

    from core.sampling import SamplingParams
    from core.serve.scheduler import Job, QueueFull, Scheduler

    sched = Scheduler(load_model(folder, max_seq_len=CONTEXT, max_batch_size=2), max_queue=1)
    loop = asyncio.new_event_loop()
    job = lambda: Job([1, 2], SamplingParams(), stream=False, loop=loop)  # noqa: E731
    try:
        first = job()
        sched.submit(first)
        with pytest.raises(QueueFull, match="1 requests are already waiting"):
            sched.submit(job())
        sched._take(block=False)  # the thread's own calls: the queue into a free row
        sched._admit()
        assert [seq.job for seq in sched.running] == [first] and sched.queued == 0
        sched.submit(job())  # room again
        assert sched.queued == 1
    finally:
        loop.close()
