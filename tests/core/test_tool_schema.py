"""The schemas forced calls are held to (core/chat/tool_schema.py): a function's parameters
closed as OpenAI's strict mode closes them, nested objects too; `strict: false` keeps JSON
Schema's meaning; and the grammar llguidance compiles from them writes no undeclared property,
no duplicate key, and ends after one call when calls are not parallel."""

from __future__ import annotations

import json

import jsonschema
import pytest

from core.chat.tool_calls import forced_schema
from core.chat.tool_schema import closed

ADDRESS = {
    "type": "object",
    "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
    "required": ["street"],
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "home": ADDRESS,
        "pets": {"type": "array", "items": {"properties": {"kind": {"type": "string"}}}},
        "tags": {"type": "object", "additionalProperties": {"type": "string"}},  # a map: kept
        "extra": {"type": "object", "additionalProperties": True},
        "either": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/pos"}]},
        "both": {"allOf": [ADDRESS, {"properties": {"city": {"type": "string"}}}]},
    },
    "required": ["name"],
    "$defs": {"pos": {"type": "object", "properties": {"x": {"type": "number"}}}},
}
WEATHER = {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
GOOD = {
    "name": "Ann",
    "home": {"street": "Main"},
    "pets": [{"kind": "cat"}],
    "tags": {"a": "b"},
    "extra": {"anything": [1]},
    "either": {"x": 1},
    "both": {"street": "Main", "city": "Paris"},
}


def test_objects_are_closed_at_every_depth_and_keep_their_word():
    s = closed(PERSON)
    assert s["additionalProperties"] is False and PERSON.get("additionalProperties") is None
    jsonschema.validate(GOOD, s)
    for path, bad in [
        ((), {"country": "FR"}),  # an undeclared property, at the top
        (("home",), {"country": "FR"}),  # nested
        (("pets", 0), {"age": 3}),  # in an array's items (an object by its `properties`)
        (("either",), {"x": 1, "y": 2}),  # behind a $ref into $defs
    ]:
        doc = json.loads(json.dumps(GOOD))
        target = doc
        for key in path:
            target = target[key]
        target.update(bad)
        jsonschema.validate(doc, PERSON)  # JSON Schema's meaning: allowed
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, s)
    with pytest.raises(jsonschema.ValidationError):  # required ones stay required
        jsonschema.validate({"home": {"street": "x"}}, s)
    pair = closed({"type": "array", "items": [PERSON, {"type": ["object", "null"]}]})
    assert [x["additionalProperties"] for x in pair["items"]] == [False, False]
    # an allOf's members are not closed against each other; the whole still validates
    assert "additionalProperties" not in s["properties"]["both"]["allOf"][0]


def test_forced_schemas_close_arguments_unless_the_function_says_strict_false():
    invented = {"city": "Paris", "country": "FRANCE"}
    jsonschema.validate({"city": "Paris"}, forced_schema([WEATHER], "get_weather"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(invented, forced_schema([WEATHER], "get_weather"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            [{"name": "get_weather", "parameters": invented}], forced_schema([WEATHER], None)
        )
    strict = {**WEATHER, "strict": True}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(invented, forced_schema([strict], "get_weather"))
    loose = {**WEATHER, "strict": False}  # JSON Schema's meaning, as asked
    jsonschema.validate(invented, forced_schema([loose], "get_weather"))
    # a function without parameters takes none
    none = forced_schema([{"name": "get_time"}], "get_time")
    jsonschema.validate({}, none)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"zone": "CET"}, none)


def _accepts(schema: dict, text: str) -> bool:
    """Whether llguidance's grammar for `schema` (as the server compiles it) takes `text`."""
    import llguidance

    from core.structured import grammar, schema_text

    tok = llguidance.LLTokenizer(_byte_tokenizer(), n_vocab=257, eos_token=[256])
    m = llguidance.LLMatcher(tok, grammar(schema_text(schema)), log_level=0)
    return all(m.consume_token(b) for b in text.encode()) and m.is_accepting()


def _byte_tokenizer() -> str:
    """tokenizer.json of a byte-level tokenizer: one token per byte, and an end token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    table = {c: i for i, c in enumerate(sorted(alphabet, key=_byte_of))}
    tok = Tokenizer(models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<end>", special=True)])
    return tok.to_str()


def _byte_of(c: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    rest = [b for b in range(256) if b not in printable]
    n = ord(c)
    return n if n in printable else rest[n - 256]


def test_the_grammar_writes_no_invented_or_duplicate_key_and_one_call_when_not_parallel():
    named = forced_schema([WEATHER], "get_weather")
    assert _accepts(named, '{"city":"Paris"}')
    assert not _accepts(named, '{"city":"Paris","country":"FRANCE"}')
    assert not _accepts(named, '{"city":"Paris","city":"Lyon"}')
    assert _accepts(WEATHER["parameters"], '{"city":"Paris","country":"FRANCE"}')  # (as given)
    one = forced_schema([WEATHER], None, parallel=False)
    call = '{"name":"get_weather","parameters":{"city":"Paris"}}'
    assert _accepts(one, f"[{call}]")
    assert not _accepts(one, f"[{call},{call}]")
    assert _accepts(forced_schema([WEATHER], None), f"[{call},{call}]")


def test_an_auto_answer_gives_one_call_when_calls_are_not_parallel():
    from core.chat.tool_calls import ToolUse, read

    text = (
        'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Lyon"}}</tool_call>'
    )
    for parallel, cities in ((True, ["Paris", "Lyon"]), (False, ["Paris"])):
        s = ToolUse([WEATHER], "auto", "hermes", parallel).stream()
        deltas = s.feed(text) + s.finish()
        assert s.complete() and [json.loads(a)["city"] for _, a in s.calls] == cities
        assert "".join(t for kind, t, _ in deltas if kind == "content") == "Sure."
    assert len(read(ToolUse([WEATHER], "auto", "hermes").grammar(), text)[1]) == 2
