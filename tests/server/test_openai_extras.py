"""Issue 23's OpenAI API fields through HTTP with the official openai client: response_format on
the embedded SmolLM2-135M (which answers in prose unless constrained), and n > 1, logit_bias,
echo and unknown fields on the tiny model of test_server.py (answers equal Model.generate)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch
from test_server import KEY, Server, folder  # noqa: F401  (folder: a fixture)

from core import load_model
from core.serve.app import create_app

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a fictional person."}]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def smol():
    server = Server(create_app(load_model("smollm2", max_seq_len=256), "smollm2", api_key=KEY))
    yield client_of(server)
    server.close()


@pytest.fixture(scope="module")
def alone(folder):  # noqa: F811
    return load_model(folder)


@pytest.fixture(scope="module")
def tiny(folder):  # noqa: F811
    server = Server(create_app(load_model(folder, max_batch_size=4), "tiny", api_key=KEY))
    yield client_of(server)
    server.close()


# --- response_format (structured output) ------------------------------------------------------
def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


def test_json_schema_answer_validates_and_streams_alike(smol):
    plain = smol.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=24, temperature=0.0
    )
    with pytest.raises(json.JSONDecodeError):  # the premise: prose when unconstrained
        json.loads(plain.choices[0].message.content)
    kw = dict(model="smollm2", messages=ASK, max_tokens=60, temperature=0.0)
    kw["response_format"] = schema_format(PERSON)
    r = smol.chat.completions.create(**kw)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.choices[0].finish_reason == "stop"
    chunks = smol.chat.completions.create(**kw, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content


def test_json_object_answer_is_an_object(smol):
    r = smol.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=40,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize(
    ("response_format", "param", "words"),
    [
        (schema_format({"type": "objekt"}), "response_format.json_schema.schema", "$.type"),
        ({"type": "json_schema"}, "response_format", "needs a 'json_schema'"),
        ({"type": "yaml"}, "response_format.type", "json_schema"),
    ],
)
def test_bad_response_format_is_400_naming_it(smol, response_format, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        smol.chat.completions.create(
            model="smollm2", messages=ASK, max_tokens=4, response_format=response_format
        )
    assert err.value.param == param and words in err.value.message
    assert smol.chat.completions.create(model="smollm2", messages=ASK, max_tokens=2).choices


# --- n > 1 ------------------------------------------------------------------------------------
def test_n_choices_are_seeded_one_by_one(tiny, alone):
    kw = dict(max_new_tokens=10, temperature=1.0, ignore_eos=True)
    want = [alone.generate("Hi", seed=7 + i, **kw).text for i in range(3)]
    assert len(set(want)) == 3  # the seeds tell the choices apart
    r = tiny.completions.create(
        model="tiny", prompt="Hi", n=3, seed=7, max_tokens=10, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
    assert r.usage.prompt_tokens == len(alone.encode_prompt("Hi"))
    assert r.usage.completion_tokens == 30


def test_n_choices_stream_by_index(tiny, alone):
    kw = dict(model="tiny", messages=ASK, n=2, seed=3, max_tokens=8, temperature=1.0)
    whole = tiny.chat.completions.create(**kw)
    texts, finished = ["", ""], set()
    chunks = tiny.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
        usage = c.usage or None
    assert texts == [c.message.content for c in whole.choices] and finished == {0, 1}
    assert texts[0] != texts[1]
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_n_above_the_batch_is_400(tiny):
    with pytest.raises(openai.BadRequestError) as err:
        tiny.completions.create(model="tiny", prompt="Hi", n=5, max_tokens=2)
    assert err.value.param == "n" and "--max-batch-size" in err.value.message


# --- logit_bias, echo -------------------------------------------------------------------------
def test_logit_bias_bans_the_greedy_token(tiny, alone):
    first = alone.generate("Hi", max_new_tokens=1).token_ids[0]
    kw = dict(model="tiny", prompt="Hi", max_tokens=1, temperature=0.0, logprobs=0)
    r = tiny.completions.create(**kw)
    banned = tiny.completions.create(**kw, logit_bias={str(first): -100})
    assert r.choices[0].text == alone.tokenizer.decode([first])
    assert banned.choices[0].text != r.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:
        tiny.completions.create(model="tiny", prompt="Hi", max_tokens=1, logit_bias={"99999": 1})
    assert err.value.param == "logit_bias" and "99999" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        tiny.completions.create(model="tiny", prompt="Hi", max_tokens=1, logit_bias={"5": 300})
    assert err.value.param == "logit_bias"


def test_echo_puts_the_prompt_first(tiny, alone):
    answer = alone.generate("Hi there", max_new_tokens=6, temperature=0.0).text
    kw = dict(model="tiny", prompt="Hi there", max_tokens=6, temperature=0.0, echo=True)
    assert tiny.completions.create(**kw).choices[0].text == "Hi there" + answer
    chunks = tiny.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hi there" + answer
    with pytest.raises(openai.BadRequestError) as err:
        tiny.completions.create(**kw, logprobs=1)
    assert err.value.param == "echo"


def test_chat_template_kwargs_reach_the_template(tiny, alone):
    """vLLM's chat_template_kwargs: Llama 3.1's template writes its date_string variable."""
    kw = dict(model="tiny", messages=ASK, max_tokens=1)
    plain = tiny.chat.completions.create(**kw)
    dated = tiny.chat.completions.create(
        **kw, extra_body={"chat_template_kwargs": {"date_string": "1 January 2031"}}
    )
    want = alone.tokenizer.apply_chat_template(ASK, date_string="1 January 2031")
    assert dated.usage.prompt_tokens == len(want) != plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as err:
        tiny.chat.completions.create(
            **kw, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}
        )
    assert err.value.param == "chat_template_kwargs" and "add_generation_prompt" in str(err.value)


# --- fields Zoo does not implement ------------------------------------------------------------
def test_unknown_fields_are_400_and_harmless_extras_pass(tiny):
    with pytest.raises(openai.BadRequestError) as err:
        tiny.completions.create(model="tiny", prompt="Hi", max_tokens=1, suffix="!")
    assert err.value.param == "suffix" and "unknown field 'suffix'" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        tiny.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=1, extra_body={"guided_regex": "a+"}
        )
    assert err.value.param == "guided_regex"
    r = tiny.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=1, user="u1", store=False, metadata={"k": "v"}
    )
    assert r.choices[0].message.content is not None
