"""gpt-oss's harmony format: a chat template shaped like openai/gpt-oss-20b's renders through
Zoo's sandbox as transformers renders it, and `zoo run` / `zoo chat` print the final channel
only (the analysis channel never reaches stdout nor the chat history)."""

from __future__ import annotations

import pytest
from fixtures.chat_tokenizers import template

from core import RequestError
from core.chat.harmony import HarmonyReader, is_harmony
from core.cli.commands import _answer
from core.tokenizer import StreamDecoder, Tokenizer

# condensed from gpt-oss's template: a macro for the system header, strftime_now, namespace,
# the system/developer split, analysis kept only after the last user turn, final vs return
HARMONY_TEMPLATE = template("gpt_oss_condensed")
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
    """Streams fixed token ids' text as Model.stream does (special tokens skipped unless
    `skip_special_tokens=False`)."""

    def __init__(self, tokenizer: Tokenizer, text: str):
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompt, skip_special_tokens: bool = True, **params):
        decoder = StreamDecoder(self.tokenizer, skip_special_tokens)

        class Stream:
            result = None

            def __iter__(s):
                for t in self.ids:
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
    assert not is_harmony(plain)


CALLING = (
    "<|channel|>analysis<|message|>The user wants the weather: call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}'
)


def read(text: str, size: int, tools: bool = True) -> tuple[dict[str, str], list]:
    """{kind: joined text} and the deltas of a harmony answer fed in pieces of `size`."""
    reader = HarmonyReader(tools)
    deltas = [d for i in range(0, len(text), size) for d in reader.feed(text[i : i + size])]
    deltas += reader.finish()
    joined: dict[str, str] = {}
    for kind, text_, _ in deltas:
        joined[kind] = joined.get(kind, "") + text_
    return joined, deltas


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_a_streamed_harmony_answer_splits_by_channel_in_any_cut(size):
    joined, deltas = read(GENERATED, size)
    assert joined == {"reasoning": "SECRET reasoning about 3+3.", "content": "It is 6."}
    kinds = [kind for kind, _, _ in deltas]
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    joined, deltas = read(CALLING, size)  # a commentary message to a function: a tool call
    assert joined == {
        "reasoning": "The user wants the weather: call get_weather.",
        "call": "get_weather",
        "args": '{"city": "Paris"}',
    }
    assert [d for d in deltas if d[0] == "call"] == [("call", "get_weather", 0)]
    if size < 5:  # the arguments go out as they come
        assert len([d for d in deltas if d[0] == "args"]) > 3


def test_other_harmony_messages():
    preamble = "<|channel|>commentary<|message|>Checking the weather.<|end|>"
    assert read(preamble, 3)[0] == {"content": "Checking the weather."}  # shown to the user
    assert read(CALLING, 3, tools=False)[0] == {  # no tools offered: no call
        "reasoning": "The user wants the weather: call get_weather."
    }
    assert read("no channels at all", 4)[0] == {"content": "no channels at all"}
    assert read("<|channel|>final<|message|>a < b <|", 2)[0] == {"content": "a < b <|"}
