"""vLLM's /tokenize and /detokenize on `zoo serve`, through HTTP on 127.0.0.1 (the tiny model of
test_server.py, whose tokenizer is Llama 3's, with its chat template): against the model's own
tokenizer, which is what the completion and chat endpoints run."""

from __future__ import annotations

import json

import pytest
from test_server import Server, folder  # noqa: F401  (folder: a fixture)

from core import load_model
from core.serve.app import create_app

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def served(folder):  # noqa: F811
    model = load_model(folder, max_seq_len=64)
    srv = Server(create_app(model, "tiny", api_key="k"))
    yield srv, model.tokenizer
    srv.close()


def post(srv: Server, path: str, body: dict):
    return srv.raw("POST", path, json.dumps(body), key=None)  # outside /v1: no key needed


def test_a_prompt_tokenizes_as_a_completion_runs_it(served):
    srv, tok = served
    status, body = post(srv, "/tokenize", {"model": "tiny", "prompt": "Hello world"})
    assert status == 200, body
    assert body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 64
    _, bare = post(srv, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert bare["tokens"] == tok.encode("Hello world", add_special_tokens=False)
    assert bare["tokens"] != body["tokens"]  # the BOS


def test_messages_tokenize_through_the_chat_template(served):
    srv, tok = served
    _, body = post(srv, "/tokenize", {"messages": MESSAGES})
    assert body["tokens"] == tok.apply_chat_template(MESSAGES)
    _, bare = post(srv, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert bare["tokens"] == tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert len(bare["tokens"]) < len(body["tokens"])


def test_detokenize_gives_the_text_back_with_its_special_tokens(served):
    srv, tok = served
    _, ids = post(srv, "/tokenize", {"prompt": "Hello world"})
    status, body = post(srv, "/detokenize", {"model": "tiny", "tokens": ids["tokens"]})
    assert status == 200, body
    assert body["prompt"] == tok.decode(ids["tokens"], skip_special_tokens=False)
    assert body["prompt"].endswith("Hello world") and body["prompt"] != "Hello world"


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, None),  # both
        ("/tokenize", {}, 400, None),  # neither
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),  # outside the vocabulary
    ],
)
def test_bad_requests_are_refused_by_name(served, path, body, status, param):
    got, answer = post(served[0], path, body)
    assert got == status, answer
    if param is not None:
        assert answer["error"]["param"] == param
