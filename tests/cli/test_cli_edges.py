"""The `zoo` command's rough edges (issue 34): a device this torch cannot use, half dtypes on
a CPU, the prompt as an argument, --max-tokens, a cut --json answer, and `zoo chat`'s unknown
commands and Ctrl-C (mid-answer: the text shown stays in the history; at the prompt: 130)."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

import pytest
from conftest import LLAMA32, chat_llama_folder
from test_cli import QUESTION, zoo

from core import load_model
from core.api import resolve_device_dtype
from core.cli import commands
from core.cli.common import run_dtype
from core.errors import RequestError


@pytest.mark.parametrize("device", ["cuda:99", "nonsense"])
def test_a_device_this_torch_cannot_use_is_one_line(device, checkpoint):
    root, _ = checkpoint(LLAMA32)
    with pytest.raises(RequestError, match=rf"device '{device}' cannot be used: .*available: cpu"):
        resolve_device_dtype(device, None, "float32")
    with pytest.raises(RequestError, match=f"device '{device}'"):  # Python users too
        load_model(root, device=device)
    out = zoo("run", str(root), "--device", device, "-p", "hi")
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"zoo: error: device '{device}' cannot be used")


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="a CUDA build: cuda is usable here"
)
def test_cuda_on_a_cpu_build_names_the_build():
    with pytest.raises(RequestError, match=r"built without CUDA; available: cpu$"):
        resolve_device_dtype("cuda", None, "float32")


def test_half_dtypes_on_a_cpu_load_float32_with_a_note(capsys, monkeypatch, checkpoint):
    monkeypatch.delenv("ZOO_KERNELS", raising=False)
    args = argparse.Namespace(dtype="bfloat16", device="cpu", tp=None)
    assert run_dtype(args) == "float32"
    note = capsys.readouterr().err
    assert note.count("\n") == 1 and "--dtype bfloat16 on a CPU" in note and "float32" in note
    assert run_dtype(argparse.Namespace(dtype="float32", device="cpu", tp=None)) == "float32"
    assert run_dtype(argparse.Namespace(dtype=None, device="cpu", tp=None)) is None
    assert capsys.readouterr().err == ""  # asked float32 or nothing: no note
    root, _ = checkpoint(LLAMA32)
    out = zoo("info", str(root), "--dtype", "float16", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert "(loaded as float32)" in out.stdout and "zoo: note: --dtype float16" in out.stderr
    capsys.readouterr()
    monkeypatch.setenv("ZOO_KERNELS", "torch")  # the modules anyway: the dtype asked is kept
    assert run_dtype(args) == "bfloat16" and capsys.readouterr().err == ""


def test_the_prompt_is_an_argument_or_p_never_both():
    out = zoo("run", "smollm2", QUESTION, "--max-tokens", "24", "--temperature", "0")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout and " 24 new tokens" not in out.stderr  # (ends before 24)
    both = zoo("run", "smollm2", QUESTION, "-p", "hi")
    assert both.returncode == 1 and both.stderr.startswith("zoo: error: two prompts")
    none = zoo("run", QUESTION)  # the one argument: the model's
    assert none.returncode == 1 and none.stderr.startswith("zoo: error: no prompt")
    assert f"({QUESTION!r} was read as the model)" in none.stderr


@pytest.mark.parametrize(
    "argv",
    [["smollm2", "hi"], ["smollm2", "--seed", "1", "hi"], ["--seed", "1", "smollm2", "hi"]],
)
def test_the_prompt_may_follow_the_flags(argv):
    args = commands.parse(["run", *argv])
    assert (args.model, args.text, args.prompt) == ("smollm2", "hi", None)


@pytest.mark.parametrize("command", ["run", "chat"])
def test_max_tokens_is_max_new_tokens(command):
    args = commands.build_parser().parse_args([command, "--max-tokens", "7"])
    assert args.max_new_tokens == 7


def test_a_json_answer_cut_by_the_limit_is_warned_about():
    out = zoo("run", "smollm2", "List ten animals as JSON.", "--json", "--max-tokens", "4")
    assert out.returncode == 0, out.stderr
    assert "zoo: warning: the answer reached --max-new-tokens (4 tokens)" in out.stderr
    assert "JSON is cut off" in out.stderr


def test_run_past_the_context_names_the_flag_that_fits(tmp_path):
    """A Llama 3.2 of 256 positions: the prompt and --max-tokens over them is one line with the
    --max-tokens that fits (not load_model's max_seq_len, which the command has no flag for)."""
    from tokenizers import Tokenizer

    root = str(chat_llama_folder(tmp_path))
    out = zoo("run", root, "hi", "--raw", "--max-tokens", "300")
    n = len(Tokenizer.from_file(f"{root}/tokenizer.json").encode("hi").ids)  # with the BOS
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (
        f"zoo: error: prompt ({n} tokens) + --max-tokens 300 = {n + 300} exceeds the context of "
        f"256 tokens this model runs with; pass --max-tokens {256 - n} or fewer\n"
    )
    out = zoo("run", root, "hi " * 300, "--max-tokens", "1")
    assert out.returncode == 1 and out.stderr.endswith("; shorten the prompt\n"), out.stderr


def test_another_models_tokenizer_is_named(checkpoint):
    """A vocabulary of 96 beside a Llama 3 tokenizer of 300+ ids: `zoo run` (chat-templated or
    --raw) and Model.generate on text say the tokenizer is not the model's, not 'token ids
    outside the vocabulary' (ids the user never typed)."""
    from fixtures.chat_tokenizers import build_tokenizer_folder

    root, _ = checkpoint(LLAMA32)
    build_tokenizer_folder(root, "llama3")
    want = f"zoo: error: the tokenizer of {root} gives token id(s) ["
    for raw in ([], ["--raw"]):
        out = zoo("run", str(root), "hi", "--max-tokens", "2", *raw)
        assert out.returncode == 1 and out.stderr.startswith(want), out.stderr
        assert "past the model's vocabulary (vocab_size 96): it is not this model's" in out.stderr
    with pytest.raises(RequestError, match="it is not this model's tokenizer"):
        load_model(root, max_seq_len=16).generate("hi", max_new_tokens=1)


def chat(typed: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "core.cli", "chat", "--max-new-tokens", "8"],
        input=typed, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_chat_answers_an_unknown_command_with_the_list():
    out = chat("/foo bar\n/exit\n")
    assert out.returncode == 0, out.stderr
    assert "unknown command /foo; the commands: /system TEXT" in out.stderr
    assert " prompt tokens at " not in out.stderr  # nothing was sent to the model


def _default_sigint() -> None:
    """In the child before exec: Ctrl-C as a terminal's shell leaves it. A test process may
    hold SIGINT ignored (seen in the suite's workers: an ignored signal stays ignored across
    exec, and Python then installs no KeyboardInterrupt for it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_at_the_chat_prompt_exits_130():
    p = subprocess.Popen(
        [sys.executable, "-m", "core.cli", "chat"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_default_sigint,
    )  # fmt: skip
    try:
        while "zoo chat:" not in (line := p.stderr.readline()):  # the banner: loaded, reading
            assert line, "zoo chat ended before its banner"
        p.send_signal(signal.SIGINT)
        try:  # stdin stays open: closing it first, the child may read EOF (exit 0) before
            p.wait(timeout=60)  # it handles the signal
        except subprocess.TimeoutExpired:  # (one caught before input() began reading leaves
            p.send_signal(signal.SIGINT)  # the read waiting: a user presses Ctrl-C again)
        # communicate reads both pipes to the end (a child blocked writing to a full pipe
        # never exits); the time is generous for a loaded machine (the suite runs 2 processes)
        _, err = p.communicate(timeout=180)
        assert p.returncode == 130 and "Traceback" not in err
    finally:
        if p.poll() is None:
            p.kill()


class Interrupted:
    """A model's stream that a Ctrl-C stops after `after` pieces."""

    def __init__(self, stream, after: int):
        self.stream, self.after, self.result = stream, after, None

    def __iter__(self):
        for i, piece in enumerate(self.stream):
            if i == self.after:
                raise KeyboardInterrupt
            yield piece

    def close(self):
        self.stream.close()


def test_ctrl_c_mid_answer_keeps_the_text_shown(monkeypatch, capsys):
    """The second turn's prompt holds the first answer as far as it was printed; Ctrl-C at the
    next prompt then ends `zoo chat` with 130."""
    model = load_model("smollm2", max_seq_len=256)
    stream = model.stream
    streams = iter([lambda *a, **k: Interrupted(stream(*a, **k), 5)])
    monkeypatch.setattr(model, "stream", lambda *a, **k: next(streams, stream)(*a, **k))
    monkeypatch.setattr(commands, "load", lambda args: model)
    sent, render = [], commands.prompt_ids

    def prompt_ids(m, messages, raw):
        sent.append(messages)
        return render(m, messages, raw)

    monkeypatch.setattr(commands, "prompt_ids", prompt_ids)
    typed = iter(["Tell me a long story about a dragon.", "Go on."])

    def read_message():
        line = next(typed, None)
        if line is None:
            raise KeyboardInterrupt
        return line

    monkeypatch.setattr("core.cli.chat_session.read_message", read_message)
    assert commands.main(["chat", "--max-new-tokens", "6", "--temperature", "0"]) == 130
    out = capsys.readouterr()
    assert "(stopped)" in out.err
    shown = out.out.split("\n")[0]  # the first answer, as far as it went
    assert shown.strip()
    last = sent[-1]
    assert [m["role"] for m in last] == ["user", "assistant", "user"]
    assert last[1]["content"] == shown and last[2]["content"] == "Go on."
