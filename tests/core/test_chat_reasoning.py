"""`zoo run` / `zoo chat` with reasoning models (thinking on stderr, or hidden; never in the
answer nor the history) and `zoo chat`'s session: multi-line input, /system, /reset, and a
history kept within the context."""

from __future__ import annotations

import pytest
from fixtures.chat_tokenizers import build_tokenizer_folder
from test_harmony import GENERATED, FakeModel, harmony_folder, harmony_tokenizer  # noqa: F401

from core.cli.chat_session import Session, read_message
from core.cli.commands import _answer
from core.errors import RequestError
from core.tokenizer import Tokenizer

THINKING = "<think>\nThe user asks 3+3. That is 6.\n</think>\n\nIt is 6."


@pytest.fixture
def thinking_tokenizer(tmp_path):
    build_tokenizer_folder(tmp_path, "llama3")
    tok = Tokenizer.from_folder(tmp_path)
    tok.chat_template = "{{ messages[-1].content }}{# answers: split('</think>') #}"
    return tok


@pytest.mark.parametrize("hide", [False, True])
def test_a_think_block_goes_to_stderr_or_nowhere(thinking_tokenizer, capsys, hide):
    reply = _answer(FakeModel(thinking_tokenizer, THINKING), [1, 2], {}, hide_reasoning=hide)
    out, err = capsys.readouterr()
    assert out == "It is 6.\n" and reply == "It is 6."
    assert ("The user asks 3+3. That is 6." in err) is not hide


@pytest.mark.parametrize("hide", [False, True])
def test_harmony_analysis_goes_to_stderr_or_nowhere(harmony_folder, capsys, hide):  # noqa: F811
    model = FakeModel(harmony_tokenizer(harmony_folder), GENERATED)
    reply = _answer(model, [1, 2], {}, hide_reasoning=hide)
    out, err = capsys.readouterr()
    assert out == "It is 6.\n" and reply == "It is 6."
    assert ("SECRET reasoning about 3+3." in err) is not hide


def lines(*typed: str):
    it = iter(typed)
    return lambda prompt: next(it)


def test_multi_line_messages():
    assert read_message(lines("one line")) == "one line"
    assert read_message(lines("first \\", "second \\", "third")) == "first \nsecond \nthird"
    assert read_message(lines('"""', "def f():", "    return 1", '"""')) == "def f():\n    return 1"


class Counting:
    """A model stand-in whose prompts are one token per character."""

    max_seq_len = 100

    def encode_prompt(self, text):
        return list(text)


def render(messages):
    return list("".join(f"{m['role']}:{m['content']};" for m in messages))


def test_commands_and_a_history_kept_within_the_context(capsys):
    s = Session(Counting(), "Be brief.", max_new_tokens=40)  # 60 tokens of room
    # a command ran: "" (nothing to send); None: quit; else the message to send
    assert s.command("/system Be terse.") == "" and s.system == "Be terse."
    assert s.command("/exit") is None and s.command("hi /x") == "hi /x"
    assert s.command("/nope") == "" and "unknown command /nope" in capsys.readouterr().err
    assert s.command("//etc is a folder") == "/etc is a folder"
    for i in range(3):
        s.history += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]
    s.history.append({"role": "user", "content": "last question"})
    prompt = s.prompt(render)
    assert len(prompt) <= 60 and prompt == render(s.messages())
    assert s.history[0]["content"] != "q0" and s.history[-1]["content"] == "last question"
    assert "dropped the" in capsys.readouterr().err
    assert s.command("/reset") == "" and s.history == []
    s.history.append({"role": "user", "content": "x" * 80})  # alone past the room
    with pytest.raises(RequestError, match=r"leaves no room .*; shorten it$"):
        s.prompt(render)
    s.history.append({"role": "user", "content": "x" * 70})  # past it with its answer
    n = len(render(s.messages()))
    with pytest.raises(RequestError, match=f"or start zoo chat with --max-new-tokens {100 - n} "):
        s.prompt(render)
    assert s.command("/system") == "" and s.system is None
