"""`zoo serve` through the official openai client against a real uvicorn server on 127.0.0.1:
a tiny random Llama with a Llama 3 tokenizer for the API's behaviour (answers equal to
Model.generate alone, batching, streaming, errors, auth, disconnects), SmolLM2 for a real answer."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import uvicorn
from conftest import chat_llama_folder

from core import load_model
from core.decode_step import DecodeStep

KEY = "sekret"
PROMPTS = ["Why is the sky blue?", "Hi", "天空 😀 hello", "def hello(name):"]
IDLE = {"status": "ok", "running": 0, "waiting": 0}  # /health with no request in the server
EXTRA = {"top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids"}  # vLLM's


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes: a second intra-op thread only adds synchronization on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Throttle:
    """The model's network, slowed down on demand (`delay` seconds a step) so that a test can
    hold a batch running; records the batch size and the width (tokens a row: the padded prompt
    in a prefill, 1 in a decode step) of every call."""

    def __init__(self, net):
        self.net, self.delay, self.batch_sizes, self.widths = net, 0.0, [], []

    def __call__(self, ids, start_pos, **kw):
        self.batch_sizes.append(ids.shape[0])
        self.widths.append(ids.shape[1])
        time.sleep(self.delay)
        return self.net(ids, start_pos, **kw)

    def __getattr__(self, name):
        return getattr(self.net, name)


class Server:
    """uvicorn in a thread on a free port of 127.0.0.1."""

    def __init__(self, app):
        sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def raw(self, method: str, path: str, body: str | None = None, key: str | None = KEY):
        """(status, parsed JSON) of one plain HTTP request."""
        conn = http.client.HTTPConnection(self.url.removeprefix("http://"), timeout=30)
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        out = resp.status, json.loads(resp.read())
        conn.close()
        return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return chat_llama_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def alone(folder):
    """The same checkpoint with a batch of one: the reference for every answer."""
    return load_model(folder)


@pytest.fixture(scope="module")
def served(folder):
    """(server, throttle) of the tiny model, batches of up to 4, behind an API key."""
    from core.serve.app import create_app

    model = load_model(folder, max_batch_size=4)
    throttle = model.net = Throttle(model.net)
    model.step = DecodeStep(throttle)  # decode steps through the throttle too
    model.step.fused = None  # the fused CPU step would run the blocks past the throttle
    server = Server(create_app(model, "tiny", api_key=KEY))
    yield server, throttle
    server.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def request_kw(kind: str, kw: dict) -> dict:
    """SamplingParams keywords -> the openai client's (vLLM's extras in extra_body)."""
    out = {"max_tokens": kw["max_new_tokens"], "extra_body": {}}
    for k, v in kw.items():
        if k == "logprobs" and kind == "chat":
            out.update(logprobs=True, top_logprobs=v)
        elif k != "max_new_tokens":
            (out["extra_body"] if k in EXTRA else out)[k] = v
    return out


def ask(client, kind: str, prompt: str, kw: dict, **extra):
    if kind == "chat":
        messages = [{"role": "user", "content": prompt}]
        return client.chat.completions.create(
            model="tiny", messages=messages, **request_kw(kind, kw), **extra
        )
    return client.completions.create(model="tiny", prompt=prompt, **request_kw(kind, kw), **extra)


def logprobs_of(response, kind: str) -> list[float]:
    lps = response.choices[0].logprobs
    return [x.logprob for x in lps.content] if kind == "chat" else lps.token_logprobs


def reference(model, kind: str, prompt: str, kw: dict):
    if kind == "chat":
        prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return model.generate(prompt, **kw)


def counts(usage) -> dict:
    """A usage without prompt_tokens_details (the server's and Model.generate's prefix caches
    are not the same): that count is tested in test_limits_metrics.py and test_prefix_cache.py."""
    out = dict(usage) if isinstance(usage, dict) else usage.model_dump(exclude_none=True)
    out.pop("prompt_tokens_details", None)
    return out


def text_of(response, kind: str) -> str:
    choice = response.choices[0]
    return choice.message.content if kind == "chat" else choice.text


# --- answers ----------------------------------------------------------------------------------
def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert served[0].raw("GET", "/health", key=None) == (200, IDLE)


def test_model_retrieve(served, client):
    """GET /v1/models/{id}: the object /v1/models lists; another id is a 404 model_not_found."""
    got = client.models.retrieve("tiny")
    assert got.model_dump() == client.models.list().data[0].model_dump()
    assert got.id == "tiny" and got.object == "model" and got.model_extra["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.body["code"] == "model_not_found" and "'tiny'" in err.value.body["message"]
    status, body = served[0].raw("GET", "/v1/models/org/some-model")  # an id with a slash
    assert status == 404 and body["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_answer_equals_generate(client, alone, kind):
    kw = dict(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
    got = ask(client, kind, PROMPTS[0], kw)
    want = reference(alone, kind, PROMPTS[0], kw)
    assert text_of(got, kind) == want.text
    assert got.choices[0].finish_reason == "length" and got.model == "tiny"
    assert counts(got.usage) == counts(want.usage)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_equals_answer(client, alone, kind):
    kw = dict(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    whole = ask(client, kind, PROMPTS[2], kw)
    want = reference(alone, kind, PROMPTS[2], kw)
    assert text_of(whole, kind) == want.text
    assert counts(whole.usage) == counts(want.usage)
    opts = {"include_usage": True}
    chunks = list(ask(client, kind, PROMPTS[2], kw, stream=True, stream_options=opts))
    pieces = [
        (c.choices[0].delta.content if kind == "chat" else c.choices[0].text) or ""
        for c in chunks
        if c.choices
    ]
    assert "".join(pieces) == text_of(whole, kind)
    assert len([p for p in pieces if p]) > 1  # it streams
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(whole.usage)


def test_stop_string_cuts_the_answer(client, alone):
    kw = dict(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    full = reference(alone, "completion", PROMPTS[0], kw).text
    stop = full[len(full) // 2 :][:2]
    got = ask(client, "completion", PROMPTS[0], kw, stop=[stop])
    assert got.choices[0].text == full[: full.index(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_logprobs(client, alone):
    kw = dict(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    want = reference(alone, "chat", PROMPTS[1], {**kw, "logprobs": 3}).logprobs
    chat = ask(client, "chat", PROMPTS[1], kw, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [x.logprob for x in content] == pytest.approx([w.logprob for w in want], abs=1e-4)
    assert all(len(x.top_logprobs) == 3 for x in content)
    # completions: logprobs=n; streamed, each chunk carries its own tokens'
    want = reference(alone, "completion", PROMPTS[1], {**kw, "logprobs": 2}).logprobs
    whole = ask(client, "completion", PROMPTS[1], kw, logprobs=2).choices[0].logprobs
    assert whole.token_logprobs == pytest.approx([w.logprob for w in want], abs=1e-4)
    assert all(len(top) <= 2 for top in whole.top_logprobs)
    streamed = []
    for chunk in ask(client, "completion", PROMPTS[1], kw, logprobs=2, stream=True):
        if chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(whole.token_logprobs, abs=1e-6)


# --- request fields -> SamplingParams -------------------------------------------------------
def test_top_k_minus_one_is_off(client, alone):
    """vLLM's top_k -1 means no top-k: a seeded draw as with top_k left out, not as top_k 1."""
    kw = dict(max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    off = reference(alone, "completion", PROMPTS[0], kw).text
    assert off != reference(alone, "completion", PROMPTS[0], {**kw, "top_k": 1}).text
    got = ask(client, "completion", PROMPTS[0], {**kw, "top_k": -1})
    assert got.choices[0].text == off


def test_max_completion_tokens_wins_over_max_tokens(client, alone):
    kw = dict(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    want = reference(alone, "chat", PROMPTS[0], kw)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    got = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=10,
        max_completion_tokens=3,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert got.usage.completion_tokens == 3 and got.choices[0].finish_reason == "length"
    assert got.choices[0].message.content == want.text


def test_content_parts_are_joined_into_one_text(client, alone):
    """A list of text parts renders the prompt its concatenation does; other parts are 400."""
    kw = dict(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    want = reference(alone, "chat", PROMPTS[0], kw)
    parts = [{"type": "text", "text": "Why is the sky"}, {"type": "text", "text": " blue?"}]
    got = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": parts}],
        max_tokens=8,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert counts(got.usage) == counts(want.usage)
    assert got.choices[0].message.content == want.text
    image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": [parts[0], image]}], max_tokens=1
        )
    assert err.value.param == "messages"


def test_default_temperature_is_one(client, alone):
    """No temperature (and a generation_config.json without one): OpenAI's 1, not greedy."""
    kw = dict(max_new_tokens=12, seed=11, ignore_eos=True)
    want = reference(alone, "completion", PROMPTS[3], {**kw, "temperature": 1.0}).text
    for other in (0.0, 0.5):  # the seed tells these temperatures apart
        assert want != reference(alone, "completion", PROMPTS[3], {**kw, "temperature": other}).text
    assert ask(client, "completion", PROMPTS[3], kw).choices[0].text == want


def test_concurrent_requests_are_batched_and_equal_each_alone(served, client, alone):
    """16 clients at once, mixing chat and completions, greedy and seeded sampling, penalties
    and lengths: all answered, each as Model.generate answers it alone."""
    throttle = served[1]
    cases = []
    for i in range(16):
        kw = [
            dict(temperature=0.0),
            dict(temperature=1.0, seed=i),
            dict(temperature=0.8, top_p=0.9, top_k=20, seed=100 + i),
            dict(temperature=0.0, frequency_penalty=0.5, repetition_penalty=1.3),
        ][i % 4]
        kw.update(max_new_tokens=6 + i % 5, ignore_eos=i % 3 != 0)
        if i % 3 == 1:  # tokens compared one by one through their log-probabilities
            kw["logprobs"] = 1
        cases.append(("chat" if i % 2 else "completion", PROMPTS[i // 4], kw))
    throttle.delay, throttle.batch_sizes = 0.005, []
    try:
        with ThreadPoolExecutor(len(cases)) as pool:
            answers = list(pool.map(lambda c: ask(client, *c), cases))
    finally:
        throttle.delay = 0.0
    assert max(throttle.batch_sizes) == 4  # batched, never past the cache's rows
    for (kind, prompt, kw), got in zip(cases, answers, strict=True):
        want = reference(alone, kind, prompt, kw)
        assert text_of(got, kind) == want.text, (kind, prompt, kw)
        assert got.choices[0].finish_reason == want.finish_reason
        assert got.usage.completion_tokens == len(want.token_ids)
        if "logprobs" in kw:
            want_lps = [x.logprob for x in want.logprobs]
            assert logprobs_of(got, kind) == pytest.approx(want_lps, abs=1e-4)


# --- disconnects ------------------------------------------------------------------------------
# Bounded by steps, not seconds: a long request of 200 steps of 20 ms whose client leaves must
# end its wave well before its end, so a quick request sent afterwards (it waits for the next
# wave) is answered within 100 more model calls however slowly a busy machine runs them.
LONG = dict(max_new_tokens=200, temperature=0.0, ignore_eos=True)


def quick_answer(client) -> None:
    """A greedy 3-token completion, answered in full."""
    kw = dict(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    got = ask(client, "completion", PROMPTS[1], kw)
    assert got.usage.completion_tokens == 3 and got.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "waiting"])
def test_disconnect_frees_the_slot(served, client, stream):
    """A long request whose client goes away stops, and the next wave starts: run to its end,
    the long request would hold the batch for 200 steps."""
    throttle = served[1]
    throttle.delay, throttle.batch_sizes = 0.02, []
    try:
        if stream:
            chunks = ask(client, "completion", PROMPTS[1], LONG, stream=True)
            next(iter(chunks))  # this prompt's first token is text
            chunks.close()
        else:
            with pytest.raises(openai.APITimeoutError):
                ask(client.with_options(timeout=0.5), "completion", PROMPTS[1], LONG)
        left = len(throttle.batch_sizes)  # calls before the client went away
        quick_answer(client)
    finally:
        throttle.delay = 0.0
    assert len(throttle.batch_sizes) - left < 100  # the long row was stopped, not run to 200


def test_request_cancelled_in_the_queue_never_runs(served, client, alone):
    """Four long streams hold every row; a fifth request waits in the queue and its client
    gives up: it is never prefilled (no model call as wide as its prompt, of which a row may
    hold at most the BOS token), and the server answers the next request."""
    throttle = served[1]
    prompt = "a prompt no other test sends, long enough to stand out"
    n = len(alone.encode_prompt(prompt))
    throttle.delay, throttle.widths = 0.02, []
    streams = []
    try:
        for _ in range(4):
            streams.append(ask(client, "completion", PROMPTS[1], LONG, stream=True))
            next(iter(streams[-1]))  # its row runs
        with pytest.raises(openai.APITimeoutError):
            ask(client.with_options(timeout=0.3), "completion", prompt, LONG)
        for chunks in streams:
            chunks.close()
        quick_answer(client)
    finally:
        throttle.delay = 0.0
    assert max(throttle.widths) < n - 1
    # and its handler was answered, not left waiting for ever
    tasks, deadline = served[0].server.server_state.tasks, time.monotonic() + 60
    while tasks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not tasks


# --- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=10_000), "max_tokens"),  # past the 256-token context
        (dict(max_tokens=5, max_completion_tokens=10_000), "max_completion_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=5), "n"),  # more choices than the batch holds (4)
        (dict(stop=[""]), "stop"),
        (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
        (dict(extra_body={"top_k": "many"}), "top_k"),
        (dict(logprobs=True, top_logprobs=30), "top_logprobs"),
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(client, kw, param):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=messages, **kw)
    assert err.value.status_code == 400 and err.value.param == param
    assert err.value.type == "invalid_request_error" and err.value.message
    quick_answer(client)


def test_prompt_too_long_and_unknown_model(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=list(range(1, 300)), max_tokens=1)
    assert err.value.code == "context_length_exceeded" and "256" in err.value.message
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    assert err.value.code == "model_not_found" and "tiny" in err.value.message
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.completions.create(model="tiny", prompt=[], max_tokens=1)


def test_malformed_json_and_missing_fields(served):
    server = served[0]
    status, body = server.raw("POST", "/v1/chat/completions", '{"model": "tiny", "messages": [')
    assert status == 400 and "malformed JSON" in body["error"]["message"]
    status, body = server.raw("POST", "/v1/completions", json.dumps({"model": "tiny"}))
    assert status == 400 and body["error"]["param"] == "prompt"
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_api_key_required(served, client):
    server = served[0]
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    status, body = server.raw("POST", "/v1/completions", "{", key=None)  # 401 before parsing
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert server.raw("GET", "/health", key=None)[0] == 200


# --- the command -----------------------------------------------------------------------------
def test_zoo_serve_command(folder):
    """`zoo serve` binds first (a busy port is a one-line error, no model loaded), then serves
    until Ctrl-C; the key may come from $ZOO_API_KEY."""
    busy = socket.create_server(("127.0.0.1", 0))
    cmd = [sys.executable, "-m", "core.cli", "serve", str(folder), "--max-batch-size", "2"]
    port = str(busy.getsockname()[1])
    out = subprocess.run([*cmd, "--port", port], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert out.stderr.startswith(f"zoo: error: cannot listen on 127.0.0.1:{port}")
    busy.close()

    env = {**os.environ, "ZOO_API_KEY": KEY}
    proc = subprocess.Popen(
        [*cmd, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        line = proc.stdout.readline()
        url = re.search(r"at (http://\S+)/v1 \(batches of up to 2", line)
        assert url, line + proc.stderr.read() if proc.poll() is not None else line
        server = Server.__new__(Server)
        server.url = url[1]
        deadline = time.monotonic() + 30
        while True:  # uvicorn starts a moment after the line
            try:
                assert server.raw("GET", "/health", key=None)[0] == 200
                break
            except ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert server.raw("GET", "/v1/models", key=None)[0] == 401
        status, body = server.raw("GET", "/v1/models")
        assert status == 200 and body["data"][0]["id"] == str(folder)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


# --- a real model -----------------------------------------------------------------------------
def test_smollm2_answers_paris():
    from core.serve.app import create_app

    server = Server(create_app(load_model("smollm2", max_seq_len=128), "smollm2"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        answer = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        assert "Paris" in answer.choices[0].message.content
    finally:
        server.close()
