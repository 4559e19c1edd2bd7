"""`zoo chat`'s session: multi-line input, the slash commands, and a history kept within the
model's context (the oldest turns dropped, with a note, when the next answer would not fit)."""

from __future__ import annotations

import sys
from collections.abc import Callable

from core.errors import RequestError

COMMANDS = "/system TEXT, /system, /reset, /help, /exit"
HELP = (
    "zoo chat: /system TEXT sets the system prompt (/system alone clears it), /reset clears the "
    "history, /help shows this, /exit quits (// sends a message that begins with /); end a line "
    'with \\ to go on, or put a message between """ lines; Ctrl-C stops an answer, and at the '
    "prompt quits."
)


def read_message(read: Callable[[str], str] = input) -> str:
    """One message: a line, lines joined by a trailing backslash, or lines between two lines
    of three double quotes. EOFError / KeyboardInterrupt pass through."""
    line = read("> ")
    if line.strip() == '"""':
        lines = []
        while (more := read("... ")).strip() != '"""':
            lines.append(more)
        return "\n".join(lines).strip()
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = read("... ")
    return "\n".join([*lines, line]).strip()


class Session:
    """The conversation: a system prompt and user / assistant turns."""

    def __init__(self, model, system: str | None, max_new_tokens: int):
        self.model, self.system, self.max_new = model, system, max_new_tokens
        self.history: list[dict] = []

    def command(self, line: str) -> str | None:
        """A typed line -> the message to send ("" where there is none: a command ran), or None
        to quit. An unknown /command is answered with the list of them, not sent; a line
        beginning with // is sent with one / less."""
        if not line.startswith("/") or line.startswith("//"):
            return line.removeprefix("/") if line.startswith("//") else line
        word, _, rest = line.partition(" ")
        if word in ("/exit", "/quit"):
            return None
        if word == "/reset":
            self.history.clear()
            print("(history cleared)", file=sys.stderr)
        elif word == "/system":
            self.system = rest.strip() or None
            print(f"(system prompt {'set' if self.system else 'cleared'})", file=sys.stderr)
        elif word in ("/help", "/?"):
            print(HELP, file=sys.stderr)
        else:
            print(
                f"(unknown command {word}; the commands: {COMMANDS}; // sends a message that "
                "begins with /)",
                file=sys.stderr,
            )
        return ""

    def answered(self, text: str) -> None:
        """The answer to the last user turn: kept even when stopped part-way (the next turn sees
        what was shown); none at all (stopped at once, or failed) drops the question too."""
        if text:
            self.history.append({"role": "assistant", "content": text})
        elif self.history and self.history[-1]["role"] == "user":
            self.history.pop()

    def messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history

    def prompt(self, render: Callable[[list[dict]], list[int] | str]) -> list[int] | str:
        """The prompt of the whole conversation, its oldest turns dropped until it leaves room
        for max_new_tokens (RequestError when the last message alone does not fit)."""
        room = self.model.max_seq_len - self.max_new
        dropped = 0
        while True:
            prompt = render(self.messages())
            n = len(prompt) if isinstance(prompt, list) else len(self.model.encode_prompt(prompt))
            if n <= room:
                break
            if len(self.history) <= 1:
                self.history.clear()
                fits, also = self.model.max_seq_len - n, ""
                if fits > 0:
                    also = f", or start zoo chat with --max-new-tokens {fits} or fewer"
                raise RequestError(
                    f"the message ({n} tokens) leaves no room for an answer of "
                    f"{self.max_new} tokens in the context ({self.model.max_seq_len}); shorten "
                    f"it{also}"
                )
            self.history = self.history[2:]  # the oldest user message and its answer
            dropped += 2
        if dropped:
            print(f"(dropped the {dropped} oldest messages to fit the context)", file=sys.stderr)
        return prompt
