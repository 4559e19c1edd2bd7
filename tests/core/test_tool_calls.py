"""Tool-call reading per family (whole answers, and streams cut anywhere: content first, a call's
head, its arguments in pieces that join into the whole answer's), format detection from the real
chat templates, and the schemas that force a call."""

from __future__ import annotations

import json

import jsonschema
import pytest
from fixtures.chat_tokenizers import LLAMA31_TEMPLATE, LLAMA32_TEMPLATE, QWEN25_TEMPLATE

from core.chat.tool_calls import call_id, family, forced_schema, parse, read, template_arguments
from core.chat.tool_formats import GRAMMARS
from core.chat.tool_formats.call_stream import CallStream, listed, named

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME = {"name": "get_time", "arguments": {"zone": "CET"}}
ARGS = json.dumps(WEATHER["arguments"])

# what each family's model writes (special tokens kept), and the calls in it
WRITTEN = {
    "hermes": [
        (
            f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>',
            "",
            [WEATHER],
        ),
        (
            f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
            "</tool_call>",
            "Let me check.",
            [WEATHER, TIME],
        ),
    ],
    "llama3": [
        (f'{{"name": "get_weather", "parameters": {ARGS}}}', "", [WEATHER]),
        (f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS}}}', "", [WEATHER]),
        (
            f'{{"name": "get_weather", "parameters": {ARGS}}}; '
            '{"name": "get_time", "parameters": {"zone": "CET"}}',
            "",
            [WEATHER, TIME],
        ),
    ],
    "mistral": [
        (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}}}]', "", [WEATHER]),
        (
            f'Sure. [TOOL_CALLS]get_weather[ARGS]{ARGS}[TOOL_CALLS]get_time[ARGS]{{"zone": "CET"}}',
            "Sure.",
            [WEATHER, TIME],
        ),
    ],
    "deepseek": [
        (
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
            f"```json\n{ARGS}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "",
            [WEATHER],
        ),
        (
            "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            f"{ARGS}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
            '{"zone": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            "Checking.",
            [WEATHER, TIME],
        ),
    ],
}
CASES = [(fam, *case) for fam, cases in WRITTEN.items() for case in cases]


@pytest.mark.parametrize(("fam", "text", "content", "calls"), CASES)
def test_each_family_parses_its_calls(fam, text, content, calls):
    assert parse(fam, text) == (content, calls)


def streamed(grammar, text: str, size: int) -> tuple[str, list[tuple[str, str]], list]:
    """(content, [(name, arguments)], deltas) of `text` fed in pieces of `size` characters."""
    s = CallStream(grammar)
    deltas = [d for i in range(0, len(text), size) for d in s.feed(text[i : i + size])]
    deltas += s.finish()
    content = "".join(t for kind, t, _ in deltas if kind == "content")
    names = [t for kind, t, _ in deltas if kind == "call"]
    args = [
        "".join(t for kind, t, k in deltas if kind == "args" and k == n) for n in range(len(names))
    ]
    return content, list(zip(names, args, strict=True)), deltas


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(("fam", "text", "content", "calls"), CASES)
def test_a_stream_cut_anywhere_reads_as_the_whole_answer(fam, text, content, calls, size):
    got_content, got_calls, deltas = streamed(GRAMMARS[fam], text, size)
    assert (got_content, got_calls) == read(GRAMMARS[fam], text)
    assert [(n, json.loads(a)) for n, a in got_calls] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    heads = [k for kind, _, k in deltas if kind == "call"]
    assert heads == list(range(len(calls)))  # one head per call, indexed 0, 1, ...
    for k in heads:  # each call's head comes before its arguments, content before all calls
        first = [j for j, (kind, _, i) in enumerate(deltas) if i == k]
        assert deltas[first[0]][0] == "call"
    kinds = [kind for kind, _, _ in deltas]
    if "content" in kinds and "call" in kinds:
        assert max(j for j, kind in enumerate(kinds) if kind == "content") < kinds.index("call")


def test_long_arguments_stream_in_pieces_as_written():
    args = json.dumps({"text": "word " * 60, "n": [1, 2, {"a": "}{]["}]})
    text = f'Sure.\n<tool_call>\n{{"name": "write", "arguments": {args}}}\n</tool_call>'
    _, calls, deltas = streamed(GRAMMARS["hermes"], text, 4)
    pieces = [t for kind, t, _ in deltas if kind == "args"]
    assert len(pieces) > 20 and calls == [("write", args)]  # the written text, exactly
    # the name goes out before the arguments are complete
    head = next(j for j, d in enumerate(deltas) if d[0] == "call")
    assert head < len(deltas) - 5


def test_held_back_text_goes_out_once_decided():
    s = CallStream(GRAMMARS["hermes"])
    assert s.feed("Let me ") == [("content", "Let me", None)]  # a space may precede a call
    assert s.feed("check <") == [("content", " check", None)]  # "<" may start <tool_call>
    assert s.feed("b") == [("content", " <b", None)]  # it did not
    s = CallStream(GRAMMARS["llama3"])  # a call may only start the answer
    assert s.feed("\n") == [] and s.feed("Hi {x}") == [("content", "\nHi {x}", None)]
    s = CallStream(GRAMMARS["llama3"])  # JSON that is no call: released when that is clear
    assert s.feed('{"temp') == [] and s.feed('erature": 21}') == [
        ("content", '{"temperature": 21}', None)
    ]
    s = CallStream(GRAMMARS["mistral"])
    assert s.feed("[TOOL_CALLS]get_") == [] and s.feed("time[ARGS]{") == [
        ("call", "get_time", 0),
        ("args", "{", 0),
    ]


def test_forced_answers_stream_as_calls():
    _, calls, deltas = streamed(named("get_weather"), ARGS, 3)
    assert deltas[0] == ("call", "get_weather", 0) and calls == [("get_weather", ARGS)]
    two = '[{"name": "get_time", "parameters": {"zone": "CET"}}, '
    two += '{"name": "get_time", "parameters": {}}]'
    assert streamed(listed, two, 5)[1] == [("get_time", '{"zone": "CET"}'), ("get_time", "{}")]
    assert read(listed, '[{"name": "get_ti') == ('[{"name": "get_ti', [])  # cut short


@pytest.mark.parametrize("fam", list(GRAMMARS))
@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny.",
        '{"temperature": 21}',  # JSON, but no call
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # cut short
        "[TOOL_CALLS]not json",
    ],
)
def test_text_that_is_no_call_stays_content(fam, text):
    assert parse(fam, text) == (text, [])


def test_the_real_templates_name_their_family():
    assert family(QWEN25_TEMPLATE) == "hermes"
    assert family(LLAMA31_TEMPLATE) == "llama3"
    assert family(LLAMA32_TEMPLATE) == "llama3"
    assert family("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert family("{{ '<｜tool▁calls▁begin｜>' }}") == "deepseek"


def test_call_ids():
    assert call_id().startswith("call_") and call_id() != call_id()
    mistral = call_id("mistral")  # Mistral's templates refuse any other id
    assert len(mistral) == 9 and mistral.isalnum()


TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "kelvin"]}},
            "required": ["city"],
        },
    },
    {"name": "get_time"},  # no parameters: any object
]


def test_forced_schemas_accept_calls_and_refuse_others():
    named = forced_schema(TOOLS, "get_weather")
    jsonschema.validate(WEATHER["arguments"], named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"unit": "celsius"}, named)
    required = forced_schema(TOOLS, None)
    jsonschema.validate([{"name": "get_time", "parameters": {}}], required)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "x", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    two = [{"name": "get_time", "parameters": {}}] * 2
    jsonschema.validate(two, required)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls: false
        jsonschema.validate(two, forced_schema(TOOLS, None, parallel=False))


def test_earlier_arguments_reach_templates_as_objects_that_join_as_written():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    written = '{"city":"Paris",  "unit": "celsius"}'  # as the model wrote it
    args = template_arguments(written)
    template = "{{ 'json\\n' + a + '\\n' }}|{{ a | tojson }}|{{ a.city }}|{{ a | length }}"
    out = ImmutableSandboxedEnvironment().from_string(template).render(a=args)
    assert out == f'json\n{written}\n|{{"city": "Paris", "unit": "celsius"}}|Paris|2'
    assert template_arguments("[1, 2]") == [1, 2]  # (not an object: as parsed)
