"""Structured output and logit_bias through Model.generate, on the embedded SmolLM2-135M:
a model this small does not write JSON when asked, so a parse that succeeds is the grammar's."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from core import load_model
from core.errors import RequestError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_model("smollm2", max_seq_len=256, max_batch_size=2)


@pytest.fixture(scope="module")
def question(model):
    messages = [{"role": "user", "content": "Describe a fictional person."}]
    return model.tokenizer.apply_chat_template(messages)


def test_free_text_is_not_json(model, question):
    """The premise: unconstrained, the model answers in prose."""
    text = model.generate(question, max_new_tokens=24).text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_json_schema_answer_parses_and_validates(model, question):
    r = model.generate(question, max_new_tokens=80, json_schema=PERSON)
    jsonschema.validate(json.loads(r.text), PERSON)
    assert r.finish_reason == "stop"
    assert r.text.startswith('{"name":')  # the schema's property order is kept


def test_schema_as_json_text_and_json_object(model, question):
    r = model.generate(question, max_new_tokens=60, json_schema=json.dumps(PERSON))
    jsonschema.validate(json.loads(r.text), PERSON)
    r = model.generate("The capital of France is", max_new_tokens=60, json_object=True)
    assert isinstance(json.loads(r.text), dict)


def test_a_constrained_row_leaves_its_neighbour_alone(model, question):
    """One batch, a constrained row beside a free one: each equals itself run alone."""
    free = model.encode_prompt("The capital of France is")
    constrained = {"max_new_tokens": 12, "json_schema": PERSON}
    alone = [model.generate(question, **constrained), model.generate(free, max_new_tokens=12)]
    params = [
        model._start([question], constrained)[1],
        model._start([free], {"max_new_tokens": 12})[1],
    ]
    with torch.inference_mode():
        loop = model.token_loop([question, free], params)
        while True:
            try:
                next(loop)
            except StopIteration as done:
                results = done.value
                break
    assert results[0].text.startswith("{")
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]


@pytest.mark.parametrize(
    ("schema", "culprit"),
    [
        ({"type": "objekt"}, "$.type"),
        ({"type": "object", "properties": {"a": {"minimum": "x"}}}, "$.properties.a.minimum"),
        ("{not json", "not valid JSON"),
        ([1, 2], "a JSON schema is an object"),
    ],
)
def test_invalid_schema_is_a_request_error_naming_the_spot(model, schema, culprit):
    with pytest.raises(RequestError, match="json_schema") as err:
        model.generate("Hi", max_new_tokens=4, json_schema=schema)
    assert culprit in str(err.value)


def test_logit_bias_bans_and_forces_tokens(model):
    prompt = "The capital of France is"
    first = model.generate(prompt, max_new_tokens=1).token_ids[0]
    banned = model.generate(prompt, max_new_tokens=1, logit_bias={str(first): -100})
    assert banned.token_ids[0] != first
    forced = model.tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = model.generate(prompt, max_new_tokens=3, logit_bias={forced: 100})
    assert r.token_ids == [forced] * 3


@pytest.mark.parametrize(
    ("bias", "message"),
    [({10**6: 1}, "outside the vocabulary"), ({5: 101}, "[-100, 100]"), ({"x": 1}, "token ids")],
)
def test_bad_logit_bias_is_named(model, bias, message):
    with pytest.raises(RequestError, match="logit_bias") as err:
        model.generate("Hi", max_new_tokens=2, logit_bias=bias)
    assert message in str(err.value)


def test_a_grammar_that_gives_out_fails_its_row_alone(model, question):
    """A schema that compiles but whose answers never end (a required recursion): llguidance
    gives out while the answer is written; that row's error, not a crash of the batch."""
    loop = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    with pytest.raises(RequestError, match="grammar gave out"):
        model.generate(question, max_new_tokens=8, json_schema=loop, temperature=0.0)


def test_json_with_ignore_eos_is_refused_by_name(model, question):
    """A grammar ends on an eos token; ignore_eos leaves none: a RequestError, not llguidance's
    bare ValueError (the server answers 400)."""
    with pytest.raises(RequestError, match="ignore_eos"):
        model.generate(question, max_new_tokens=8, json_object=True, ignore_eos=True)
    r = model.generate(question, max_new_tokens=40, json_object=True, ignore_eos=True,
                       stop_token_ids=[2])  # fmt: skip
    assert r.text.startswith("{")
