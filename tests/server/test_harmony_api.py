"""gpt-oss's harmony format through HTTP with the openai client: a tiny gpt-oss checkpoint
(sliding and full layers, experts) with gpt-oss's markers as special tokens and a condensed
gpt-oss template, its network scripted to write an analysis message then a final one, or a
commentary message to a function. The analysis streams as reasoning_content deltas while it is
written and the final channel as content deltas after it (no marker leaks); a commentary call
comes back as tool_calls, streamed in pieces."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
import torch
from conftest import make_checkpoint
from fixtures.chat_tokenizers import build_tokenizer_folder
from fixtures.tool_templates import GPT_OSS
from test_server import KEY, Server
from test_tools_api import WEATHER, scripted

from core import load_model
from core.serve.app import create_app

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = (
    "<|channel|>analysis<|message|>The user asks about the weather; I know it is sunny.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Better ask the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "unit": "celsius"}<|call|>'
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("gpt-oss")
    special = build_tokenizer_folder(root, GPT_OSS)
    # gpt-oss's generation_config: a turn ends at <|return|> or <|call|>
    stops = [special["<|return|>"], special["<|call|>"]]
    spec = dict(
        model_type="gpt_oss",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=stops,
        pad_token_id=special["<|endoftext|>"],
    )
    make_checkpoint(root, spec, seed=2)
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    model = load_model(root, max_batch_size=2, max_seq_len=512)
    script = scripted(model)
    server = Server(create_app(model, "tiny", api_key=KEY))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    yield client, model, script
    server.close()
    shutil.rmtree(root, ignore_errors=True)
    torch.set_num_threads(n)


def answering(served, written: str, **kw) -> tuple:
    """(the whole answer, the streamed chunks' choices) while the network writes `written`."""
    client, model, script = served
    script.ids = model.tokenizer.encode(written, add_special_tokens=False)
    script.prompt = len(model.tokenizer.apply_chat_template(ASK))
    kw = {"model": "tiny", "messages": ASK, "max_tokens": 200, "temperature": 0.0, **kw}
    try:
        whole = client.chat.completions.create(**kw)
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw)]
    finally:
        script.ids = None
    return whole, [c for c in chunks if c]


def test_analysis_streams_as_reasoning_then_final_as_content(served):
    whole, chunks = answering(served, ANSWER)
    message = whole.choices[0].message
    assert message.content == "It is sunny in Paris." and whole.choices[0].finish_reason == "stop"
    assert message.reasoning_content == "The user asks about the weather; I know it is sunny."
    kinds = []  # what each chunk carried, in order
    for c in chunks:
        if getattr(c.delta, "reasoning_content", None):
            kinds.append(("reasoning", c.delta.reasoning_content))
        elif c.delta.content:
            kinds.append(("content", c.delta.content))
    thought = [t for k, t in kinds if k == "reasoning"]
    said = [t for k, t in kinds if k == "content"]
    assert "".join(thought) == message.reasoning_content and "".join(said) == message.content
    assert len(thought) > 3 and len(said) > 3  # token by token as generated, not at the end
    assert [k for k, _ in kinds] == ["reasoning"] * len(thought) + ["content"] * len(said)
    assert chunks[-1].finish_reason == "stop"


def test_a_commentary_call_is_a_tool_call(served):
    whole, chunks = answering(served, CALL, tools=[WEATHER])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "Better ask the tool."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    deltas = [d for c in chunks for d in c.delta.tool_calls or []]
    head, *rest = deltas
    assert (head.index, head.function.name, head.function.arguments) == (0, "get_weather", "")
    assert len(rest) > 3 and "".join(d.function.arguments for d in rest) == call.function.arguments
    assert not any(c.delta.content for c in chunks) and chunks[-1].finish_reason == "tool_calls"
    # without tools in the request, the same answer is no call
    whole, _ = answering(served, CALL)
    assert whole.choices[0].message.tool_calls is None
