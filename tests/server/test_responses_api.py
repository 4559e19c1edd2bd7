"""The Responses API (`client.responses.create`) with the openai client, on the tiny model of
test_server.py (Llama 3.1's tokenizer and chat template): each answer equals the chat
completion of the same conversation (greedy), non-streamed and as typed events; a tool loop
through function_call / function_call_output items and previous_response_id."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch
from test_server import KEY, Server, folder  # noqa: F401  (folder: a fixture)

from core import load_model
from core.serve.app import create_app

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 4}, "unit": {"enum": ["c", "k"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather",
    "parameters": PARAMS,
}
AS_CHAT_TOOL = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "parameters")}}
AS_CHAT_TOOL["function"]["description"] = "Weather"


@pytest.fixture(scope="module")
def client(folder):  # noqa: F811
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    model = load_model(folder, max_batch_size=2, max_seq_len=1536)
    server = Server(create_app(model, "tiny", api_key=KEY))
    yield openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    server.close()
    torch.set_num_threads(n)


def chat_text(client, messages, **kw) -> tuple[str, str]:
    r = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0.0, max_tokens=12, **kw
    )
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def test_text_equals_the_chat_completion(client):
    r = client.responses.create(
        model="tiny",
        instructions="Be brief.",
        input="Hi there",
        max_output_tokens=12,
        temperature=0.0,
    )
    text, finish = chat_text(
        client,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
    )
    assert r.object == "response" and r.output_text == text
    assert [item.type for item in r.output] == ["message"]
    assert r.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens <= 12 and r.usage.input_tokens > 5
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert client.responses.retrieve(r.id).output_text == text


def test_streamed_events_build_the_same_answer(client):
    kw = dict(model="tiny", input="Hi there", max_output_tokens=12, temperature=0.0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens > 0


def test_a_tool_loop_through_items_and_previous_response_id(client):
    first = client.responses.create(
        model="tiny",
        input="Weather in Oslo?",
        tools=[WEATHER],
        max_output_tokens=60,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0.0,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    args = json.loads(call.arguments)
    jsonschema.validate(args, PARAMS)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21"}
    kw = dict(model="tiny", max_output_tokens=12, temperature=0.0, tools=[WEATHER])
    second = client.responses.create(previous_response_id=first.id, input=[result], **kw)
    # the same conversation given whole, as items: the same answer
    items = [{"role": "user", "content": "Weather in Oslo?"}]
    items.append(
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        }
    )
    again = client.responses.create(input=[*items, result], **kw)
    # ... and the chat completion of it
    turn = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
        ],
    }
    messages = [
        items[0],
        turn,
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21"},
    ]
    text, _ = chat_text(client, messages, tools=[AS_CHAT_TOOL])
    assert second.output_text == again.output_text == text and text


def test_streamed_function_call_events(client):
    kw = dict(
        model="tiny",
        input="Weather in Oslo?",
        tools=[WEATHER],
        max_output_tokens=60,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0.0,
    )
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (call,) = [i for i in whole.output if i.type == "function_call"]
    assert len(pieces) > 1 and "".join(pieces) == done.arguments == call.arguments
    (item,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert item.type == "function_call" and item.name == "get_weather"


def test_a_json_schema_format(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model="tiny",
        input="A number as JSON",
        max_output_tokens=40,
        temperature=0.0,
        text={"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(r.output_text), schema)


def test_refusals_name_the_field(client):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="tiny", input="Hi", previous_response_id="resp-nope")
    with pytest.raises(openai.BadRequestError, match="function tools"):
        client.responses.create(model="tiny", input="Hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="input_image"):
        client.responses.create(
            model="tiny", input=[{"role": "user", "content": [{"type": "input_image"}]}]
        )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp-nope")
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
