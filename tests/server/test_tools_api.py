"""Tool calls through HTTP with the openai client, on the tiny model of test_server.py (Llama 3.1's
tokenizer and chat template): forced calls (required, named) constrained to the schema; "auto"
calls parsed from what a scripted network writes; tool results back through the template."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch
from test_server import KEY, Server, folder  # noqa: F401  (folder: a fixture)

from core import load_model
from core.serve.app import create_app

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 4},
                "unit": {"enum": ["celsius", "kelvin"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": NO_ARGS}}
PICK_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Script:
    """Makes the model write given token ids while `ids` is set (the real logits otherwise):
    the logits read at position `prompt - 1 + k` force ids[k], whichever call computes them
    (a prefill, or one chunk of it; a decode step), so that reused prefixes, chunked prefills
    and steps run ahead change nothing."""

    def __init__(self):
        self.ids, self.prompt = None, 0

    def force(self, logits: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """logits (B, ..., V) whose rows were read at positions `last` (B,)."""
        if self.ids is None:
            return logits
        k = (last - (self.prompt - 1)).clamp(0, len(self.ids) - 1)
        forced = torch.full_like(logits, -30.0)
        forced.view(len(k), -1, logits.shape[-1])[
            torch.arange(len(k)), :, torch.tensor(self.ids)[k]
        ] = 30.0
        return forced


class Scripted:
    """The network (prefills) or the decode step, its logits through a Script."""

    def __init__(self, inner, script: Script, step: bool):
        self.inner, self.script, self.step = inner, script, step

    def __call__(self, ids, pos, *args, **kw):
        out = self.inner(ids, pos, *args, **kw)
        b = ids.shape[0]
        if self.step:  # (tokens (B,), positions (B,), end)
            last = pos
        else:  # (ids (B, T), start_pos, logits_at=... (B,) or all T positions)
            start = torch.as_tensor(pos).expand(b)
            at = kw.get("logits_at")
            last = start + (at if at is not None else ids.shape[1] - 1)
        return self.script.force(out, torch.as_tensor(last).reshape(b).cpu())

    def __getattr__(self, name):
        return getattr(self.inner, name)


def scripted(model) -> Script:
    """The model's network and decode step made to follow a new Script."""
    script = Script()
    model.net = Scripted(model.net, script, step=False)
    model.step = Scripted(model.step, script, step=True)
    return script


@pytest.fixture(scope="module")
def served(folder):  # noqa: F811
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    model = load_model(folder, max_batch_size=2, max_seq_len=1536)  # Llama 3.1 tool prompts: long
    script = scripted(model)
    server = Server(create_app(model, "tiny", api_key=KEY))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    yield client, model, script
    server.close()
    torch.set_num_threads(n)


def chat(client, **kw):
    kw = {"max_tokens": 150, "temperature": 0.0, **kw}
    return client.chat.completions.create(model="tiny", messages=ASK, **kw)


def streamed(client, **kw) -> tuple[str, list[dict], str]:
    """(content, tool calls joined from their deltas as clients join them, finish_reason) of
    a streamed answer."""
    content, calls, finish = "", {}, None
    for c in chat(client, stream=True, **kw):
        for choice in c.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] = (d.function and d.function.name) or call["name"]
                call["arguments"] += (d.function and d.function.arguments) or ""
            finish = choice.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def test_a_named_call_validates_against_its_schema(served):
    client = served[0]
    r = chat(client, tools=[WEATHER, TIME], tool_choice=PICK_WEATHER)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    content, calls, finish = streamed(client, tools=[WEATHER, TIME], tool_choice=PICK_WEATHER)
    assert content == "" and finish == "tool_calls"
    assert [c["name"] for c in calls] == ["get_weather"] and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)
    pieces = [  # a named call's arguments stream in pieces, as OpenAI's do
        d.function.arguments
        for c in chat(client, stream=True, tools=[WEATHER, TIME], tool_choice=PICK_WEATHER)
        for ch in c.choices
        for d in ch.delta.tool_calls or []
        if d.function and d.function.arguments
    ]
    assert len(pieces) > 3 and "".join(pieces) == calls[0]["arguments"]


def test_required_calls_one_of_the_tools(served):
    r = chat(served[0], tools=[WEATHER, TIME], tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    for call in calls:
        assert call.function.name in ("get_weather", "get_time")
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            jsonschema.validate(args, WEATHER["function"]["parameters"])
    # streamed: each call's head, then its arguments in pieces as written (greedy: the same)
    chunks = chat(served[0], tools=[WEATHER, TIME], tool_choice="required", stream=True)
    deltas = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or []]
    for k, call in enumerate(calls):
        head, *pieces = [d for d in deltas if d.index == k]
        assert head.function.name == call.function.name and head.function.arguments == ""
        assert "".join(d.function.arguments for d in pieces) == call.function.arguments
    assert len(deltas) > len(calls) * 2  # more than one piece of arguments per call


def script_answer(model, script, text: str, tools: list) -> None:
    """The next answers to ASK with these tools: `text`, then the end of turn."""
    eot = model.tokenizer.token_to_id("<|eot_id|>")
    script.ids = [*model.tokenizer.encode(text, add_special_tokens=False), eot]
    prompt = model.tokenizer.apply_chat_template(ASK, **({"tools": tools} if tools else {}))
    script.prompt = len(prompt)


def test_auto_parses_a_written_call_and_streams_it_as_deltas(served):
    client, model, script = served
    written = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    try:
        script_answer(model, script, written, [WEATHER])
        r = chat(client, tools=[WEATHER])  # tool_choice defaults to auto
        content, calls, finish = streamed(client, tools=[WEATHER])
        script_answer(model, script, written, [])  # "none": the tools are not in the prompt
        plain = chat(client, tools=[WEATHER], tool_choice="none")
        script_answer(model, script, "It is sunny.", [WEATHER])
        prose = streamed(client, tools=[WEATHER])
    finally:
        script.ids = None
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert content == "" and finish == "tool_calls"  # the JSON never leaks as content
    assert [c["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert plain.choices[0].message.content == written and not plain.choices[0].message.tool_calls
    assert prose == ("It is sunny.", [], "stop")


def test_tool_results_flow_back_through_the_template(served):
    client, model, _ = served
    arguments = {"city": "Paris", "unit": "celsius"}
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], max_tokens=2
    )
    rendered = [dict(m) for m in messages]  # as the template takes them: arguments an object
    rendered[1] = {
        **rendered[1],
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": arguments},
            }
        ],
    }
    text = model.tokenizer.render_chat(rendered, tools=[WEATHER])  # as transformers hands them
    assert "ipython<|end_header_id|>" in text and "temperature" in text  # the tool's result
    assert '"parameters": {"city": "Paris"' in text  # the call
    want = model.tokenizer.apply_chat_template(rendered, tools=[WEATHER])
    assert r.usage.prompt_tokens == len(want)


@pytest.mark.parametrize(
    ("kw", "param", "words"),
    [
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools.0.function.name",
            "Field required",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "'x', which is not among the tools (get_weather)",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]},
            "tools.0.function.parameters",
            "$.type",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools.0.function.name",
            "pattern",
        ),
    ],
)
def test_bad_tools_are_400_naming_the_field(served, kw, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        chat(served[0], **kw)
    assert err.value.param == param and words in err.value.message
    assert chat(served[0]).choices  # still serving


def test_a_template_failure_is_a_400_naming_the_message(served):
    two = [
        {"id": f"call_{k}", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
        for k in (1, 2)
    ]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": two}]
    with pytest.raises(openai.BadRequestError) as err:  # Llama 3.1's template: one call a turn
        served[0].chat.completions.create(
            model="tiny", messages=messages, tools=[TIME], max_tokens=1
        )
    assert err.value.param == "messages.1"
    assert "supports single tool-calls" in err.value.message
    assert chat(served[0]).choices  # still serving


TWO_CALLS = (
    '{"name": "get_time", "parameters": {}}; '
    '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "kelvin"}}'
)


@pytest.mark.parametrize(
    ("upto", "whole"),
    [
        ('{"city"', ["get_time"]),  # cut in the second call's arguments
        ('"kelvin"}', ["get_time", "get_weather"]),  # its arguments whole, its object not
        ('{"name": "get_ti', []),  # cut in the first call's name
    ],
)
def test_max_tokens_cutting_calls_is_length(served, upto, whole):
    client, model, script = served
    ids = model.tokenizer.encode(TWO_CALLS, add_special_tokens=False)
    # the fewest tokens that write TWO_CALLS up to the end of `upto`
    end = TWO_CALLS.index(upto) + len(upto)
    cut = next(k for k in range(len(ids)) if len(model.tokenizer.decode(ids[:k])) >= end)
    try:
        script_answer(model, script, TWO_CALLS, [WEATHER, TIME])
        r = chat(client, tools=[WEATHER, TIME], max_tokens=cut)
        content, calls, finish = streamed(client, tools=[WEATHER, TIME], max_tokens=cut)
        script_answer(model, script, TWO_CALLS, [WEATHER, TIME])
        done = chat(client, tools=[WEATHER, TIME], max_tokens=len(ids) + 1)  # not cut
    finally:
        script.ids = None
    choice = r.choices[0]
    assert r.usage.completion_tokens == cut and choice.finish_reason == "length"
    assert [c.function.name for c in choice.message.tool_calls or []] == whole
    assert all(
        isinstance(json.loads(c.function.arguments), dict) for c in choice.message.tool_calls or []
    )
    assert finish == "length" and content == (choice.message.content or "")
    # streamed, the calls begun went out as they were written; the whole ones as above
    assert [c["name"] for c in calls][: len(whole)] == whole
    assert done.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in done.choices[0].message.tool_calls] == [
        "get_time",
        "get_weather",
    ]


def test_a_forced_call_cut_by_max_tokens_is_length(served):
    for kw in ({"tool_choice": "required"}, {"tool_choice": PICK_WEATHER}):
        r = chat(served[0], tools=[WEATHER, TIME], max_tokens=4, **kw)
        assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
        assert streamed(served[0], tools=[WEATHER, TIME], max_tokens=4, **kw)[2] == "length"
