"""reasoning_content through HTTP: the tiny model of test_server.py under a chat template that
opens a think block (as DeepSeek-R1's distills do) or lets the model open one (as Qwen3),
writing a scripted answer."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from test_server import KEY, Server, folder  # noqa: F401  (folder: a fixture)
from test_tools_api import scripted

from core import load_model
from core.serve.app import create_app

# R1's distills: history answers lose their thinking; the generation prompt opens a block
OPENS = (
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n<think>\n"
    "{% endif %}"
)
LEAVES = OPENS.replace("\\n\\n<think>\\n", "\\n\\n").replace(
    "\n\n<think>\n{% endif", "\n\n{% endif"
)
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def thinking_server(folder, root, opens: bool) -> Server:  # noqa: F811
    """A server of the tiny model under a thinking template, scripted to think, then answer
    "Paris." (no API key)."""
    shutil.copytree(folder, root, dirs_exist_ok=True)
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["chat_template"] = OPENS if opens else LEAVES
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    model = load_model(root)
    script = scripted(model)
    written = "Paris is the capital.\n</think>\n\nParis."
    if not opens:
        written = "<think>\n" + written
    eot = model.tokenizer.token_to_id("<|eot_id|>")
    script.ids = [*model.tokenizer.encode(written, add_special_tokens=False), eot]
    script.prompt = len(model.tokenizer.apply_chat_template(ASK))
    return Server(create_app(model, "tiny"))


@pytest.fixture(scope="module", params=["opens", "leaves"])
def served(request, folder, tmp_path_factory):  # noqa: F811
    server = thinking_server(
        folder, tmp_path_factory.mktemp(request.param), request.param == "opens"
    )
    yield openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    server.close()


def test_the_thinking_is_reasoning_content(served):
    r = served.chat.completions.create(model="tiny", messages=ASK, max_tokens=60)
    message = r.choices[0].message
    assert message.content == "Paris."
    assert getattr(message, "reasoning_content", None) == "Paris is the capital."


def test_streamed_thinking_comes_as_reasoning_deltas(served):
    reasoning, content = "", ""
    for c in served.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, stream=True):
        for choice in c.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert reasoning.strip() == "Paris is the capital." and content == "Paris."
