"""Forced tool calls fit their function, through HTTP with the openai client on the tiny chat
Llama, sampled (temperature 1) over several prompts and seeds: the functions' schemas say no
`additionalProperties`, and every forced call's arguments still take only the declared
properties (nested objects too), so `get_weather(**arguments)` runs; `parallel_tool_calls:
false` gives exactly one call."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch
from test_server import KEY, Server, folder  # noqa: F401  (folder: a fixture)

from core import load_model
from core.chat.tool_schema import closed
from core.serve.app import create_app

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {  # no additionalProperties: JSON Schema would allow any more
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["celsius", "kelvin"]},
            },
            "required": ["city"],
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {
                "at": {
                    "type": "object",
                    "properties": {
                        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                        "minute": {"type": "integer", "minimum": 0, "maximum": 59},
                    },
                    "required": ["hour"],
                },
            },
            "required": ["at"],
        },
    },
}
PROMPTS = ["What is the weather in Paris?", "Wake me at seven.", "Hi", "天气 Tokyo?"]
SEEDS = [0, 1, 2]


def get_weather(city: str, unit: str = "celsius") -> str:
    return f"{city}: 21 {unit}"


def set_alarm(at: dict) -> str:
    def alarm(hour: int, minute: int = 0) -> str:
        return f"{hour:02}:{minute:02}"

    return alarm(**at)


FUNCTIONS = {"get_weather": get_weather, "set_alarm": set_alarm}


@pytest.fixture(scope="module")
def client(folder):  # noqa: F811
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    model = load_model(folder, max_batch_size=2, max_seq_len=2048)  # Llama 3.1 tool prompts
    server = Server(create_app(model, "tiny", api_key=KEY))
    yield openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    server.close()
    torch.set_num_threads(n)


def forced(client, prompt: str, seed: int, **kw):
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        tools=[WEATHER, ALARM],
        temperature=1.0,
        seed=seed,
        max_tokens=120,
        **kw,
    )


def check_call(call) -> None:
    """The call's arguments fit its function's schema with no property beyond the declared
    ones, at every depth, and the function runs on them."""
    f = {"get_weather": WEATHER, "set_alarm": ALARM}[call.function.name]["function"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, closed(f["parameters"]))  # additionalProperties: false
    FUNCTIONS[call.function.name](**args)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_forced_arguments_take_only_the_declared_properties(client, prompt):
    for seed in SEEDS:
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in (named, {"type": "function", "function": {"name": "set_alarm"}}):
            r = forced(client, prompt, seed, tool_choice=choice)
            (call,) = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls"
            assert call.function.name == choice["function"]["name"]
            check_call(call)
        r = forced(client, prompt, seed, tool_choice="required")
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls
        for call in r.choices[0].message.tool_calls:
            check_call(call)


def test_parallel_tool_calls_false_gives_exactly_one_call(client):
    for prompt in PROMPTS:
        for seed in SEEDS:
            r = forced(client, prompt, seed, tool_choice="required", parallel_tool_calls=False)
            assert r.choices[0].finish_reason == "tool_calls"
            (call,) = r.choices[0].message.tool_calls
            check_call(call)
