"""An agent's round trip through real clients against a SmolLM2 server: a forced call, the
assistant turn sent back as clients send it (`content: null`, or the openai SDK's own message
object), the tool's result, and the model's answer; the same loop through LangChain. SmolLM2's
template joins `content` to strings, so a null content once escaped as a 500; it shows no
tools either, so they reach it in the generic form."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from langchain_core import messages
from langchain_openai import ChatOpenAI
from test_server import KEY, Server
from test_tools_api import ASK, WEATHER
from test_tools_api import PICK_WEATHER as PICK

from core import load_model
from core.chat.tool_formats import generic
from core.serve.app import create_app


@pytest.fixture(scope="module")
def smol():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    model = load_model("smollm2", max_seq_len=512)
    server = Server(create_app(model, "smollm2", api_key=KEY))
    url = server.url + "/v1"
    yield openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120), url, model
    server.close()
    torch.set_num_threads(n)


def called(client) -> openai.types.chat.ChatCompletionMessage:
    r = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER], tool_choice=PICK, max_tokens=40
    )
    assert r.choices[0].finish_reason == "tool_calls"
    return r.choices[0].message


def answer(client, messages: list) -> str:
    r = client.chat.completions.create(
        model="smollm2", messages=messages, tools=[WEATHER], max_tokens=12, temperature=0.0
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    return r.choices[0].message.content


@pytest.mark.parametrize("sent", ["dict", "sdk-object", "no-content"])
def test_tool_result_round_trip(smol, sent):
    client, _, model = smol
    message = called(client)
    (call,) = message.tool_calls
    turn = message  # the SDK's own ChatCompletionMessage, as `messages.append(message)` sends
    if sent != "sdk-object":
        turn = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
        if sent == "no-content":
            del turn["content"]
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}
    history = [*ASK, turn, result]
    got = answer(client, history)
    # SmolLM2's template shows no tools: the prompt was the generic form's (core/chat/
    # tool_formats/generic.py), the call as the assistant's JSON and the result as JSON
    plain = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    convo = generic.conversation([*ASK, plain, result], [WEATHER["function"]])
    want = model.tokenizer.render_chat(convo)
    assert '{"tool_calls": [{"name": "get_weather"' in want
    assert '{"tool_response": {"tool_call_id": "' + call.id in want
    ids = model.tokenizer.apply_chat_template(convo)
    assert model.generate(ids, max_new_tokens=12, temperature=0.0).text == got


def test_langchain_agent_loop(smol):
    _, url, _ = smol
    llm = ChatOpenAI(
        model="smollm2", base_url=url, api_key=KEY, max_retries=0, temperature=0, max_tokens=40
    )
    ask = [messages.HumanMessage(ASK[0]["content"])]
    ai = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke(ask)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    back = messages.ToolMessage(json.dumps({"temperature": 21}), tool_call_id=call["id"])
    final = llm.bind_tools([WEATHER]).invoke([*ask, ai, back])
    assert isinstance(final.content, str) and final.content and not final.tool_calls
