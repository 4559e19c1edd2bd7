"""No request body, however odd, is a 500: hypothesis writes a few hundred JSON bodies around
the chat-completions and completions schemas (wrong types, nulls, nested junk, huge and negative
numbers, odd roles, content parts, tool calls, tools, tool_choice, response_format,
logit_bias...) and posts them to a tiny model's server (Llama 3.1's chat template); every
answer must be below 500, a 4xx one an OpenAI error object, and a stream must carry no
server error. Derandomized, answers of at most a few tokens."""

from __future__ import annotations

import http.client
import json
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import KEY, Server, folder  # noqa: F401  (folder: a fixture)

from core import load_model
from core.serve.app import create_app

SETTINGS = dict(
    derandomize=True,
    deadline=timedelta(seconds=30),  # a hang, not a slow machine
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)

# --- JSON in general --------------------------------------------------------------------------
NUMBERS = st.one_of(
    st.integers(-3, 5),
    st.sampled_from([-(2**63), 2**31, 2**64, 10**30, -1.5, 0.5, 1e308, -1e308]),
    st.floats(allow_nan=True, allow_infinity=True),  # NaN/Infinity: not JSON at all
)
ODD_TEXT = ["", "tiny", "<|eot_id|>", "{", "\x00", "\ud800"]  # a lone surrogate: no character
TEXT = st.one_of(st.text(max_size=12), st.sampled_from(ODD_TEXT))
LEAF = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JUNK = st.recursive(
    LEAF, lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3), max_leaves=6
)


def maybe(strategy):
    """Mostly the given shape, sometimes anything."""
    return st.one_of(*[strategy] * 7, JUNK)


@st.composite
def bodies(draw, required: dict, optional: dict):
    """A body of the required fields and some optional ones, each of its own shape (with odd
    values), then one or two of them (or none) replaced by anything: most bodies get past the
    schema to the code behind it."""
    body = {k: draw(s) for k, s in required.items()}
    for k in draw(st.lists(st.sampled_from(sorted(optional)), max_size=8, unique=True)):
        body[k] = draw(optional[k])
    for k in draw(st.lists(st.sampled_from([*sorted(body), "unknown"]), max_size=2, unique=True)):
        body[k] = draw(JUNK)
    return body


RECURSIVE = {  # compiles, but no answer ends: llguidance gives out while it is written
    "type": "object",
    "properties": {"a": {"$ref": "#"}},
    "required": ["a"],
}

# --- the chat request's parts -----------------------------------------------------------------
SCHEMA = st.one_of(
    st.just({"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}}),
    st.just({"type": "object", "properties": {}, "additionalProperties": False}),
    st.just({"type": "string", "pattern": "("}),
    st.just({"$ref": "#/nowhere"}),
    st.just({"type": "array", "items": {"type": "integer"}, "minItems": 5, "maxItems": 2}),
    st.just({"enum": []}),
    st.just(RECURSIVE),
    st.dictionaries(st.sampled_from(["type", "properties", "required", "items", "enum"]), JUNK),
    JUNK,
)
FUNCTION = st.fixed_dictionaries(
    {"name": maybe(st.sampled_from(["get_weather", "f", "bad name!", ""]))},
    optional={"description": maybe(TEXT), "parameters": SCHEMA, "strict": JUNK},
)
TOOL = st.fixed_dictionaries({"type": maybe(st.just("function")), "function": maybe(FUNCTION)})
ARGUMENTS = st.one_of(
    st.just('{"city": "Oslo"}'), st.just("{"), st.just("[1]"), st.just('"x"'), JUNK
)
CALL = st.fixed_dictionaries(
    {
        "id": maybe(st.just("call_1")),
        "type": maybe(st.just("function")),
        "function": maybe(
            st.fixed_dictionaries({"name": maybe(st.just("get_weather")), "arguments": ARGUMENTS})
        ),
    }
)
PART = st.fixed_dictionaries(
    {"type": maybe(st.sampled_from(["text", "image_url", "input_audio"]))},
    optional={"text": maybe(TEXT), "image_url": JUNK},
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.one_of(
            st.sampled_from(["system", "user", "assistant", "tool", "developer"]), TEXT
        )
    },
    optional={
        "content": st.one_of(TEXT, st.none(), st.lists(PART, max_size=3), JUNK),
        "tool_calls": st.one_of(st.lists(CALL, max_size=2), JUNK),
        "tool_call_id": JUNK,
        "name": JUNK,
        "reasoning_content": JUNK,
    },
)
TOOL_CHOICE = st.one_of(
    st.sampled_from(["none", "auto", "required", "any"]),
    st.fixed_dictionaries(
        {
            "type": maybe(st.just("function")),
            "function": maybe(st.fixed_dictionaries({"name": TEXT})),
        }
    ),
    JUNK,
)
RESPONSE_FORMAT = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "xml"}]),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": maybe(
                st.fixed_dictionaries({"name": maybe(TEXT)}, optional={"schema": SCHEMA})
            ),
        }
    ),
    JUNK,
)
SMALL = st.one_of(*[st.integers(1, 3)] * 6, st.integers(-1, 0), st.just(10**12))  # short
COMMON = {  # fields chat and completions requests share
    "n": st.integers(0, 3),
    "temperature": st.one_of(st.floats(0, 2), st.just(-1), st.none()),
    "top_p": st.one_of(st.floats(0.01, 1), st.just(0)),
    "top_k": st.integers(-2, 400),
    "min_p": st.floats(0, 1),
    "seed": st.one_of(st.integers(0, 2**63), st.just(-(2**64))),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=5), st.none()),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(-5, 400), max_size=3),
    "logit_bias": st.dictionaries(st.one_of(TEXT, st.sampled_from(["5", "-1", "99999"])), NUMBERS),
    "user": TEXT,
}
CHAT = bodies(
    {
        "model": st.just("tiny"),
        "messages": st.lists(MESSAGE, min_size=1, max_size=4),
        "max_tokens": SMALL,
    },
    {
        **COMMON,
        "max_completion_tokens": SMALL,
        "tools": st.lists(TOOL, max_size=3),
        "tool_choice": TOOL_CHOICE,
        "parallel_tool_calls": st.booleans(),
        "response_format": RESPONSE_FORMAT,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 30),
        "chat_template_kwargs": st.dictionaries(TEXT | st.just("messages"), JUNK),
    },
)
CONVERSATION = bodies(  # the messages and tools alone: what the chat template gets
    {"model": st.just("tiny"), "messages": st.lists(MESSAGE, min_size=1, max_size=5)},
    {"tools": st.lists(TOOL, max_size=2), "tool_choice": TOOL_CHOICE, "max_tokens": st.just(1)},
)
COMPLETION = bodies(
    {
        "model": st.just("tiny"),
        "prompt": st.one_of(
            TEXT,
            st.lists(st.integers(0, 330), max_size=4),
            st.lists(TEXT, max_size=2),
            st.lists(st.lists(st.integers(-3, 330), max_size=3), max_size=2),
            JUNK,
        ),
        "max_tokens": SMALL,
    },
    {**COMMON, "echo": st.booleans(), "logprobs": st.integers(0, 30)},
)


@pytest.fixture(scope="module")
def server(folder):  # noqa: F811
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    model = load_model(folder, max_batch_size=2, max_seq_len=1536)  # Llama 3.1's tool prompts
    model.defaults["max_new_tokens"] = 2  # a body without max_tokens: a short answer too
    server = Server(create_app(model, "tiny", api_key=KEY))
    yield server
    server.close()
    torch.set_num_threads(n)


def post(server: Server, path: str, body: dict) -> tuple[int, str]:
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
    resp = conn.getresponse()
    out = resp.status, resp.read().decode("utf-8", "replace")
    conn.close()
    return out


def check(status: int, text: str, body: dict) -> None:
    assert status < 500, f"{status} for {body!r}: {text[:500]}"
    if status >= 400:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert error["type"] == "invalid_request_error" and "param" in error and "code" in error
    elif text.startswith("data:"):  # a stream: its errors come inside it
        assert "server_error" not in text, f"for {body!r}: {text[-500:]}"


@settings(max_examples=250, **SETTINGS)
@given(body=CHAT)
def test_chat_bodies_are_never_a_500(server, body):
    check(*post(server, "/v1/chat/completions", body), body)


@settings(max_examples=150, **SETTINGS)
@given(body=CONVERSATION)
def test_conversations_are_never_a_500(server, body):
    check(*post(server, "/v1/chat/completions", body), body)


@settings(max_examples=100, **SETTINGS)
@given(body=COMPLETION)
def test_completion_bodies_are_never_a_500(server, body):
    check(*post(server, "/v1/completions", body), body)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_gives_out_is_a_400_of_its_row(server, stream):
    schema = {"type": "json_schema", "json_schema": {"name": "loop", "schema": RECURSIVE}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    body.update(response_format=schema, temperature=0, stream=stream)
    status, text = post(server, "/v1/chat/completions", body)
    if stream:  # the 200 went out first: the error comes in the stream
        assert status == 200
        text = next(line for line in text.splitlines() if '"error"' in line).removeprefix("data: ")
    else:
        assert status == 400
    assert "grammar gave out" in json.loads(text)["error"]["message"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi \ud800"}]}
    status, text = post(server, "/v1/chat/completions", body)
    assert status == 400 and "surrogate" in json.loads(text)["error"]["message"]
    del body["messages"][0]["content"]
    assert post(server, "/v1/chat/completions", body)[0] == 200  # still serving
