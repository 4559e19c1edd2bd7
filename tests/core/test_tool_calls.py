"""Tool-call parsing per family, format detection from the real chat templates, the stream's
hold-back, and the schemas that force a call."""

from __future__ import annotations

import json

import jsonschema
import pytest
from fixtures.chat_tokenizers import LLAMA31_TEMPLATE, LLAMA32_TEMPLATE, QWEN25_TEMPLATE

from core.tool_calls import (
    PARSERS,
    HoldBack,
    family,
    forced_calls,
    forced_schema,
    openai_calls,
)

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
    assert PARSERS[fam](text) == (content, calls)


@pytest.mark.parametrize("fam", list(PARSERS))
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
    assert PARSERS[fam](text) == (text, [])


def test_the_real_templates_name_their_family():
    assert family(QWEN25_TEMPLATE) == "hermes"
    assert family(LLAMA31_TEMPLATE) == "llama3"
    assert family(LLAMA32_TEMPLATE) == "llama3"
    assert family("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert family("{{ '<｜tool▁calls▁begin｜>' }}") == "deepseek"


def test_openai_calls_carry_json_arguments_and_ids():
    (call,) = openai_calls([WEATHER])
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": ARGS}


def feed_all(hold: HoldBack, pieces: list[str]) -> str:
    return "".join(hold.feed(p) for p in pieces)


def test_hold_back_streams_content_and_keeps_the_call():
    hold = HoldBack("hermes")
    out = feed_all(hold, ["Let me ", "check.\n<tool", "_call>\n{", '"name": ...}', "</tool_call>"])
    assert out == "Let me check.\n"
    assert hold.held == '<tool_call>\n{"name": ...}</tool_call>'
    hold = HoldBack("hermes")  # a '<' that starts no marker goes out in the end
    assert feed_all(hold, ["a <", "b"]) == "a <b"
    hold = HoldBack("llama3")
    assert feed_all(hold, ["\n", '{"na', 'me"}']) == "\n" and hold.held == '{"name"}'
    assert feed_all(HoldBack("llama3"), ["Hi ", "{x}"]) == "Hi {x}"  # "{" mid-answer: no call
    hold = HoldBack(None)  # a forced call: all of it
    assert feed_all(hold, ["[", "{}]"]) == "" and hold.held == "[{}]"


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
    assert forced_calls(ARGS, "get_weather") == [WEATHER]
    assert forced_calls('[{"name": "get_time", "parameters": {"zone": "CET"}}]', None) == [TIME]
    assert forced_calls('[{"name": "get_ti', None) == []  # cut short by max_tokens
