"""gpt-oss's harmony format: a chat template shaped like openai/gpt-oss-20b's renders through
Zoo's sandbox as transformers renders it, and `zoo run` / `zoo chat` print the final channel
only (the analysis channel never reaches stdout nor the chat history)."""

from __future__ import annotations

import pytest

from core import RequestError
from core.cli import _answer
from core.harmony import FinalChannel
from core.tokenizer import StreamDecoder, Tokenizer

# condensed from gpt-oss's template: a macro for the system header, strftime_now, namespace,
# the system/developer split, analysis kept only after the last user turn, final vs return
HARMONY_TEMPLATE = """\
{%- macro render_system(reasoning_effort) -%}
You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06
Current date: {{ strftime_now("%Y-%m-%d") }}

Reasoning: {{ reasoning_effort }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- endmacro -%}
{%- if reasoning_effort is not defined %}{%- set reasoning_effort = "medium" %}{%- endif %}
{{- "<|start|>system<|message|>" + render_system(reasoning_effort) + "<|end|>" }}
{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if developer_message %}
    {{- "<|start|>developer<|message|># Instructions\\n\\n" + developer_message + "\\n\\n<|end|>" }}
{%- endif %}
{%- set last_user = namespace(idx=-1) %}
{%- for message in loop_messages %}
    {%- if message.role == "user" %}{%- set last_user.idx = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in loop_messages -%}
    {%- if message.role == "assistant" -%}
        {%- if message.thinking is defined and loop.index0 > last_user.idx %}
            {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
        {%- endif %}
        {%- if loop.last and not add_generation_prompt %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
        {%- endif %}
    {%- elif message.role == "user" -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- else -%}
        {{- raise_exception("Unexpected message role: " + message.role) }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}
"""
MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"]
CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.", "thinking": "Old reasoning, dropped."},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture
def harmony_folder(tmp_path):
    from fixtures.chat_tokenizers import build_tokenizer_folder

    build_tokenizer_folder(tmp_path, "llama3")
    return tmp_path


def harmony_tokenizer(folder) -> Tokenizer:
    tok = Tokenizer.from_folder(folder)
    tok._tok.add_special_tokens(MARKERS)
    tok.chat_template = HARMONY_TEMPLATE
    return tok


def test_harmony_template_renders_in_the_sandbox(harmony_folder):
    from transformers import AutoTokenizer

    ours, hf = harmony_tokenizer(harmony_folder), AutoTokenizer.from_pretrained(harmony_folder)
    want = hf.apply_chat_template(
        CHAT,
        chat_template=HARMONY_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
        reasoning_effort="high",
    )
    assert ours.render_chat(CHAT, reasoning_effort="high") == want
    assert "Reasoning: high" in want and "Old reasoning" not in want
    assert "<|start|>developer<|message|># Instructions\n\nAnswer briefly." in want
    assert want.endswith("<|start|>user<|message|>And 3+3?<|end|><|start|>assistant")
    with pytest.raises(RequestError, match="Unexpected message role: tool"):
        ours.render_chat([*CHAT, {"role": "tool", "content": "x"}])


class FakeModel:
    """Streams fixed token ids as Model.stream does: on_token before each token's text."""

    def __init__(self, tokenizer: Tokenizer, text: str):
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompt, on_token=None, **params):
        decoder = StreamDecoder(self.tokenizer)

        class Stream:
            result = None

            def __iter__(s):
                for t in self.ids:
                    if on_token is not None:
                        on_token(0, t, None)
                    if piece := decoder.push(t):
                        yield piece

            def close(s):
                pass

        return Stream()


GENERATED = (
    "<|channel|>analysis<|message|>SECRET reasoning about 3+3.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is 6.<|return|>"
)


def test_run_prints_the_final_channel_only(harmony_folder, capsys):
    model = FakeModel(harmony_tokenizer(harmony_folder), GENERATED)
    tok = model.tokenizer
    assert tok.token_to_id("<|channel|>") in model.ids  # the markers are special tokens
    reply = _answer(model, [1, 2], {})
    out = capsys.readouterr().out
    assert out == "It is 6.\n" and reply == "It is 6."  # what chat keeps in its history
    assert "SECRET" not in out and "analysis" not in out


def test_other_chats_and_raw_prompts_print_everything(harmony_folder, capsys):
    model = FakeModel(harmony_tokenizer(harmony_folder), GENERATED)
    _answer(model, "raw text", {}, chat=False)
    assert "SECRET" in capsys.readouterr().out
    plain = Tokenizer.from_folder(harmony_folder)  # Llama's template: no channels
    assert FinalChannel.for_tokenizer(plain) is None
