"""gpt-oss's harmony format: which generated text belongs to the `final` channel.

A harmony message is `<|start|>role<|channel|>name<|message|>text<|end|>` (the last one ends
with `<|return|>` or `<|call|>`); the generation prompt stops at `<|start|>assistant`, so the
model writes a channel header first: `analysis` (its reasoning), `commentary` (tool calls) or
`final` (the answer). `zoo run` / `zoo chat` print the final channel only.
"""

from __future__ import annotations

from typing import Any

HEADER_TOKENS = ("<|start|>", "<|end|>", "<|return|>", "<|call|>")


class FinalChannel:
    """Follows a generation token by token (`on_token`, before each token's text is yielded)
    and says whether the text the last token made belongs to the final channel (`show`)."""

    def __init__(self, tokenizer: Any, channel: int, message: int, header: set[int]):
        self._tok, self._channel, self._message, self._header = tokenizer, channel, message, header
        self._name: list[int] | None = None  # a channel name's ids, while one is being read
        self.show = False  # nothing before the first channel header is the answer
        self.channel: str | None = None  # the channel the last token's text belongs to

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> FinalChannel | None:
        """A filter for a harmony-format tokenizer (its template writes `<|channel|>` and the
        vocabulary holds the markers); None for any other."""
        template = (tokenizer and tokenizer.chat_template) or ""
        channel = tokenizer.token_to_id("<|channel|>") if "<|channel|>" in template else None
        message = tokenizer.token_to_id("<|message|>") if channel is not None else None
        if message is None:
            return None
        header = {tokenizer.token_to_id(t) for t in HEADER_TOKENS} - {None}
        return cls(tokenizer, channel, message, header)

    def on_token(self, row: int, token: int, logprob: Any = None) -> None:
        if token == self._channel:
            self._name, self.show = [], False
        elif token == self._message:
            words = self._tok.decode(self._name or []).split()  # "final", "commentary to=..."
            self.channel = words[0] if words else None
            self._name, self.show = None, self.channel == "final"
        elif token in self._header:
            self._name, self.show, self.channel = None, False, None
        elif self._name is not None:
            self._name.append(token)
