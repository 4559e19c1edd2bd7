"""Tools under a chat template that cannot show them (SmolLM2's: ChatML without a `tools`
variable), through HTTP with the openai client on a tiny Llama: the tools reach the prompt in
the generic form (a system message describing them and the JSON to answer with), an answer in
that form comes back as tool_calls (whole and streamed), forced calls are written in it and fit
their function, and the calls and their results go back through the template."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest
import torch
from conftest import LLAMA32, make_checkpoint
from fixtures.chat_tokenizers import QWEN2, Family, build_tokenizer_folder
from test_server import KEY, Server
from test_tools_api import scripted

from core import load_model
from core.chat.tool_formats import generic
from core.chat.tool_schema import closed
from core.serve.app import create_app

# SmolLM2-135M-Instruct's chat template, as its tokenizer_config.json has it
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'


def get_weather(city: str) -> str:
    return f"{city}: 21"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("smol")
    family = Family(**{**QWEN2.__dict__, "name": "smollm2", "chat_template": SMOLLM2})
    special = build_tokenizer_folder(root, family)
    spec = dict(LLAMA32, vocab_size=320, max_position_embeddings=256)
    spec.update(bos_token_id=None, eos_token_id=special["<|im_end|>"])
    make_checkpoint(root, spec, seed=2)
    (root / "generation_config.json").write_text("{}")
    model = load_model(root, max_batch_size=2, max_seq_len=1024)
    script = scripted(model)
    server = Server(create_app(model, "tiny", api_key=KEY))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    yield client, model, script
    server.close()
    shutil.rmtree(root, ignore_errors=True)
    torch.set_num_threads(n)


def ask(client, messages=ASK, **kw):
    kw = {"max_tokens": 200, "temperature": 0.0, "tools": [WEATHER], **kw}
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


def prompt_of(model, messages=ASK) -> list[int]:
    """The prompt the generic form renders for `messages` with WEATHER."""
    return model.tokenizer.apply_chat_template(
        generic.conversation(messages, [WEATHER["function"]])
    )


def write(model, script, text: str, messages=ASK) -> None:
    """The next answers: `text`, then the end of turn."""
    eot = model.tokenizer.token_to_id("<|im_end|>")
    script.ids = [*model.tokenizer.encode(text, add_special_tokens=False), eot]
    script.prompt = len(prompt_of(model, messages))


def test_the_tools_reach_the_prompt_in_the_generic_form(served):
    client, model, _ = served
    bare = model.tokenizer.render_chat(ASK)
    assert model.tokenizer.render_chat(ASK, tools=[WEATHER]) == bare  # the template drops them
    text = model.tokenizer.render_chat(generic.conversation(ASK, [WEATHER["function"]]))
    assert '{"name": "get_weather", "description": "The weather in a city"' in text
    assert '{"tool_calls": [{"name": ' in text and text.startswith("<|im_start|>system\n")
    r = ask(client, max_tokens=2)
    assert r.usage.prompt_tokens == len(prompt_of(model))
    plain = ask(client, max_tokens=2, tool_choice="none")  # "none": no tools in the prompt
    assert plain.usage.prompt_tokens == len(model.tokenizer.apply_chat_template(ASK))
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 40
    system = [{"role": "system", "content": "Be brief."}, *ASK]  # the block joins the system's
    r = ask(client, messages=system, max_tokens=2)
    assert r.usage.prompt_tokens == len(prompt_of(model, system))
    assert generic.conversation(system, [WEATHER["function"]])[0]["content"].startswith(
        "Be brief.\n\nYou can call these tools"
    )


def test_an_answer_in_the_generic_form_is_a_call(served):
    client, model, script = served
    two = CALL.replace("]}", ', {"name": "get_weather", "arguments": {"city": "Lyon"}}]}')
    try:
        write(model, script, CALL)
        r = ask(client)
        chunks = [c.choices[0] for c in ask(client, stream=True) if c.choices]
        write(model, script, two)
        both = ask(client).choices[0].message.tool_calls
        one = ask(client, parallel_tool_calls=False).choices[0].message.tool_calls
        write(model, script, "It is sunny.")
        prose = ask(client)
    finally:
        script.ids = None
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.function.name == "get_weather"
    assert get_weather(**json.loads(call.function.arguments)) == "Paris: 21"
    assert "".join(c.delta.content or "" for c in chunks) == ""  # the JSON never leaks
    deltas = [d for c in chunks for d in c.delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments)["city"] for c in both] == ["Paris", "Lyon"]
    assert [json.loads(c.function.arguments)["city"] for c in one] == ["Paris"]
    assert (
        prose.choices[0].message.content == "It is sunny."
        and not prose.choices[0].message.tool_calls
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forced_calls_are_written_in_the_generic_form_and_fit(served, seed):
    client, _, _ = served
    schema = closed(WEATHER["function"]["parameters"])
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        r = ask(client, tool_choice=choice, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "tool_calls"
        for call in r.choices[0].message.tool_calls:
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, schema)
            get_weather(**args)
    r = ask(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed)
    assert len(r.choices[0].message.tool_calls) == 1


def test_calls_and_results_go_back_in_the_generic_form(served):
    client, model, _ = served
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "windy"},
    ]
    r = ask(client, messages=history, max_tokens=2)
    text = model.tokenizer.render_chat(generic.conversation(history, [WEATHER["function"]]))
    assert (
        '<|im_start|>assistant\n{"tool_calls": [{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}]}<|im_end|>\n<|im_start|>user\n{"tool_response": {"tool_call_id": '
        '"call_1", "content": {"temperature": 21}}}\n{"tool_response": {"tool_call_id": '
        '"call_2", "content": "windy"}}<|im_end|>\n<|im_start|>assistant\n'
    ) in text
    assert r.usage.prompt_tokens == len(model.tokenizer.encode(text, add_special_tokens=False))
