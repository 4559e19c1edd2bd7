"""DeepSeek V3 / R1: `<｜tool▁calls▁begin｜>`, then per call `<｜tool▁call▁begin｜>function
<｜tool▁sep｜>name` + a ```json block + `<｜tool▁call▁end｜>` (V3.1: `<｜tool▁call▁begin｜>name
<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`), then `<｜tool▁calls▁end｜>`."""

from __future__ import annotations

from core.chat.tool_formats.call_stream import CallStream

NAME = "deepseek"
CALLS, CALL = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"
SEP, END = "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
call_id = None  # OpenAI's ids


def detect(chat_template: str) -> bool:
    """Whether a chat template writes DeepSeek's `tool▁calls▁begin` marker."""
    return "tool▁calls▁begin" in chat_template


def grammar(s: CallStream):
    """Content, then the calls between the begin and end markers (V3 / R1 and V3.1 forms)."""
    if not (yield from s.content_until(CALLS)):
        return
    while True:
        yield from s.ws()
        if not (yield from s.at(CALL)):
            return
        s.i += len(CALL)
        name = (yield from s.upto(SEP)).strip()
        if name == "function":  # V3 / R1: the name on its line, then a ```json block
            name = (yield from s.upto("\n")).strip()
            yield from s.upto("```")
            yield from s.upto("\n")
        s.head(name)
        yield from s.arguments()
        yield from s.upto(END)
