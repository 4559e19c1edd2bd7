"""POST /v1/embeddings through the official openai client: a tiny Llama with a Llama 3
tokenizer and sentence-transformers files (last-token pooling, Normalize), served with the task
found automatically; embeddings equal transformers' last_hidden_state pooled the same way, and an
embeddings request between a running chat's steps leaves that chat's answer unchanged."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
from conftest import chat_llama_folder
from fixtures.embeddings import reference, rel, write_sentence_transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import KEY, Server

from core import load_model
from core.serve.app import create_app

MAX = 160  # the cache length (the chat template writes a 100-token system prompt)
TEXTS = ["Why is the sky blue?", "Hi", "天空 😀 hello, a longer text than the others"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = chat_llama_folder(tmp_path_factory.mktemp("embed"))
    write_sentence_transformers(root, "lasttoken", True)
    return root


@pytest.fixture(scope="module")
def served(folder):
    server = Server(
        create_app(load_model(folder, max_batch_size=2, max_seq_len=MAX, dtype="float32"), "tiny")
    )
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def want(folder):
    """transformers' embeddings of TEXTS, each alone: (N, hidden)."""
    from transformers import AutoModel, AutoTokenizer

    base = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    return torch.stack([reference(base, tok(t)["input_ids"], "last", True) for t in TEXTS])


def vectors(response) -> torch.Tensor:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    rows = [
        np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist()  # asked for base64
        if isinstance(d.embedding, str)
        else d.embedding
        for d in response.data
    ]
    return torch.tensor(rows)


@pytest.mark.parametrize("fmt", ["float", "base64", None])  # None: the SDK's default (base64)
def test_embeddings_equal_transformers(client, want, fmt):
    kw = {} if fmt is None else {"encoding_format": fmt}
    got = client.embeddings.create(model="tiny", input=TEXTS, **kw)
    assert got.model == "tiny" and got.object == "list"
    v = vectors(got)
    assert v.shape == want.shape
    for i in range(len(TEXTS)):
        assert rel(v[i], want[i]) < 1e-4, (i, rel(v[i], want[i]))
    ids = [load_tokens(client, t) for t in TEXTS]
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(len(x) for x in ids)


def load_tokens(client, text: str) -> list[int]:
    raw = client.post("/../tokenize", body={"prompt": text}, cast_to=object)
    return raw["tokens"]


def test_embeddings_inputs(client, want, served):
    """One text, token ids, and lists of ids: the same vectors as the texts they encode."""
    one = client.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="float")
    assert len(one.data) == 1 and rel(vectors(one)[0], want[1]) < 1e-4
    ids = [load_tokens(client, t) for t in TEXTS]
    by_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    assert torch.allclose(vectors(by_ids), want, rtol=0, atol=1e-4 * float(want.abs().max()))
    single = client.embeddings.create(model="tiny", input=ids[0], encoding_format="float")
    assert rel(vectors(single)[0], want[0]) < 1e-4
    # base64 on the wire: little-endian float32, as OpenAI's
    _, body = served.raw("POST", "/v1/embeddings", body=
        '{"model": "tiny", "input": "Hi", "encoding_format": "base64"}')  # fmt: skip
    raw = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert rel(torch.from_numpy(raw.copy()), want[1]) < 1e-4


def test_embeddings_beside_a_running_chat(client, folder, want):
    """An embeddings request run between a streaming chat's steps (in the other row) changes
    nothing in that chat's answer."""
    alone = load_model(folder, max_seq_len=MAX, dtype="float32")
    messages = [{"role": "user", "content": "Tell me a story"}]
    prompt = alone.tokenizer.apply_chat_template(messages)
    expect = alone.generate(prompt, max_new_tokens=24, temperature=0, ignore_eos=True).text
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    parts = []
    for chunk in stream:  # the chat holds a row and decodes: embed now, then read the rest
        parts.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
        if len(parts) == 2:
            v = vectors(
                client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
            )
            assert rel(v[2], want[2]) < 1e-4
    assert "".join(parts) == expect


@pytest.mark.parametrize(
    "body,param,code",
    [
        ({"input": "Hi", "dimensions": 8}, "dimensions", None),
        ({"input": ""}, "input", None),
        ({"input": []}, "input", None),
        ({"input": ["Hi", ""]}, "input.1", None),
        ({"input": [[5, 99999]]}, "input", None),
        ({"input": [[]]}, "input", None),
        ({"input": [7] * (MAX + 1)}, "input", "context_length_exceeded"),
        ({"input": "Hi", "encoding_format": "int8"}, "encoding_format", None),
        ({"input": {"text": "Hi"}}, "input", None),
        ({"input": "Hi", "extra": 1}, "extra", None),
        ({"input": ["a"] * 2049}, "input", None),
        ({"input": [True]}, "input", None),
    ],
)
def test_embeddings_errors(served, body, param, code):
    import json

    status, got = served.raw("POST", "/v1/embeddings", json.dumps({"model": "tiny", **body}))
    assert status == 400, got
    assert got["error"]["type"] == "invalid_request_error"
    assert (got["error"]["param"] or "").startswith(param), got
    assert got["error"]["code"] == code


def test_embeddings_refused_by_a_generation_server(folder, served, client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="Hi")
    app = create_app(load_model(folder), "tiny", task="generate")
    server = Server(app)
    try:
        other = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--task embed"):
            other.embeddings.create(model="tiny", input="Hi")
    finally:
        server.close()


def test_embed_task_checked_at_start(folder):
    """An unknown task, or embeddings under tensor parallelism (which CausalLM.hidden does not
    run), stop the server before it listens."""
    from core.errors import RequestError

    model = load_model(folder)
    with pytest.raises(RequestError, match="unknown task 'rerank'"):
        create_app(model, "tiny", task="rerank")
    model.net.lead = object()  # as tensor parallelism's rank 0 holds it
    with pytest.raises(RequestError, match="tensor parallelism"):
        create_app(model, "tiny")  # sentence-transformers files: the embed task
    assert create_app(model, "tiny", task="generate").state.zoo.task == "generate"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
IDS = st.lists(st.integers(-5, 400), max_size=6)  # near the vocabulary's bounds (320)
INPUT = JSON | st.text(max_size=12) | IDS | st.lists(IDS | st.text(max_size=6), max_size=3)
FIELDS = {"input": INPUT, "encoding_format": st.sampled_from(["float", "base64"]) | JSON,
          "dimensions": st.sampled_from([48, 0, -1]) | JSON}  # fmt: skip


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.fixed_dictionaries({"model": st.just("tiny") | JSON}, optional=FIELDS) | JSON)
def test_no_body_is_a_server_error(served, body):
    """Any JSON at all: a 200 or a 4xx with OpenAI's error object, never a 500."""
    import json

    status, got = served.raw("POST", "/v1/embeddings", json.dumps(body))
    assert status == 200 or (400 <= status < 500 and "error" in got), (status, got)
