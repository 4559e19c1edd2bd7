"""A bounded soak of `zoo serve` on 127.0.0.1 (well under a minute): 64 concurrent clients send
normal requests (streamed or not), streams they drop after a few chunks, malformed bodies and
over-long prompts, three rounds, against the tiny random Llama of test_server.py with 4 rows and
a queue of 32. Afterwards every accepted request ended in a full answer or an error event, the
server holds no row and no task, /health and /metrics say nothing runs or waits, and the
process's resident memory did not grow between the second and the last round."""

from __future__ import annotations

import asyncio
import random
import urllib.request

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_server import Server, folder  # noqa: F401  (folder: a fixture)

from core import load_model
from core.serve.app import create_app

CLIENTS, ROUNDS, CONTEXT = 64, 3, 256


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture
def server(folder):  # noqa: F811
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    model = load_model(folder, max_seq_len=CONTEXT, max_batch_size=4)
    srv = Server(create_app(model, "tiny", max_queue=32))
    yield srv
    srv.close()
    torch.set_num_threads(n)


async def malformed(url: str) -> int:
    """The status of a POST whose JSON body is cut off (raw HTTP/1.1 over asyncio)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = b'{"model": "tiny", "prompt": [1, 2'
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    writer.write(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    writer.close()
    return status


async def client(api: openai.AsyncOpenAI, url: str, rng: random.Random, seen: dict) -> None:
    """One client's request of a random kind, recorded in `seen` by how it ended."""
    kind = rng.choice(["stream", "stream", "drop", "whole", "malformed", "too_long"])
    prompt = [rng.randrange(3, 300) for _ in range(rng.randint(1, 20))]
    n = 200 if kind == "drop" else rng.randint(1, 24)  # a dropped stream has tokens left
    kw = dict(model="tiny", prompt=prompt, max_tokens=n, temperature=rng.choice([0.0, 1.0]))
    kw.update(seed=rng.randrange(100), extra_body={"ignore_eos": True})
    if kind == "malformed":
        assert await malformed(url) == 400  # FastAPI's invalid JSON, in OpenAI's shape
        seen["refused"] += 1
        return
    try:
        if kind == "too_long":
            kw["prompt"] = list(range(3, CONTEXT + 10))
            with pytest.raises(openai.BadRequestError, match="context length"):
                await api.completions.create(**kw)
            seen["refused"] += 1
        elif kind == "whole":
            out = await api.completions.create(**kw)
            assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == n
            seen["answered"] += 1
        else:
            await stream(api, kw, rng.randint(1, 3) if kind == "drop" else None, seen)
    except openai.APIStatusError as err:
        assert err.status_code == 503 and err.response.headers["retry-after"] == "1"
        seen["busy"] += 1


async def stream(api: openai.AsyncOpenAI, kw: dict, drop_after: int | None, seen: dict) -> None:
    """A streamed request read to its end, or dropped after `drop_after` chunks."""
    chunks = await api.completions.create(**kw, stream=True)
    got = []
    try:
        async for chunk in chunks:
            got.append(chunk)
            if drop_after is not None and len(got) >= drop_after:
                seen["dropped"] += 1
                return
    except openai.APIError:  # an error event in the stream
        seen["error_event"] += 1
        return
    finally:
        await chunks.close()
    assert got[-1].choices[0].finish_reason == "length", got[-1]
    seen["answered"] += 1


async def soak_round(url: str, seed: int) -> dict:
    seen = dict.fromkeys(["answered", "error_event", "dropped", "busy", "refused"], 0)
    api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
    rngs = [random.Random(seed * 1000 + i) for i in range(CLIENTS)]
    await asyncio.gather(*(client(api, url, rng, seen) for rng in rngs))
    await api.close()
    assert sum(seen.values()) == CLIENTS
    return seen


def idle(server: Server) -> dict:
    """Metrics once the server is idle: no handler task left (a dropped stream's handler
    ends when its row does), /health with nothing running or waiting."""
    tasks = server.server.server_state.tasks
    for _ in range(600):
        health = server.raw("GET", "/health", key=None)[1]
        if not tasks and health["running"] == health["waiting"] == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert not tasks and health == {"status": "ok", "running": 0, "waiting": 0}
    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    out = {s.name: s.value for s in samples if "finished_reason" not in s.labels}
    for s in samples:
        if s.name == "vllm:request_success_total":
            out[s.labels["finished_reason"]] = s.value
    return out


def test_soak(server):
    scheduler = server.server.config.app.state.scheduler
    totals, memory = [], []
    for round_ in range(ROUNDS):
        totals.append(asyncio.run(soak_round(server.url, round_)))
        metrics = idle(server)
        assert metrics["vllm:num_requests_running"] == metrics["vllm:num_requests_waiting"] == 0
        assert not scheduler.running and not any(scheduler.slots.busy)
        memory.append(rss_mib())
    kinds = {k: sum(t[k] for t in totals) for k in totals[0]}
    assert kinds["answered"] > CLIENTS and kinds["dropped"] > 10 and kinds["refused"] > 10
    assert kinds["error_event"] == 0  # nothing here should fail inside the server
    # the server ended every accepted request once: in full, or early for a dropped stream
    assert metrics["length"] + metrics["abort"] == kinds["answered"] + kinds["dropped"]
    assert metrics["abort"] > 0
    assert memory[-1] - memory[1] < 16, memory  # MiB; the first round warms allocators up
