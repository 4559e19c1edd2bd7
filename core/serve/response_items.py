"""The Responses API's objects (core/serve/responses.py routes them): its request, the
responses kept for `previous_response_id`, and a Response with its items (messages, function
calls, reasoning) built from a chat completion, or streamed as the typed events
(`response.output_text.delta`...) from a chat completion's chunks."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from core.serve.schemas import ApiError, request_id

MAX_KEPT = 256  # responses kept for previous_response_id / GET, least recent dropped first


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # accepted; a model reasons as its template says
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    service_tier: str | None = None


class Kept:
    """The responses a later request may continue (`previous_response_id`) or fetch: each
    one's conversation as chat messages (its instructions aside) and its Response object."""

    def __init__(self, limit: int = MAX_KEPT):
        self.limit, self.items = limit, OrderedDict()

    def put(self, rid: str, messages: list[dict], response: dict) -> None:
        self.items[rid] = (messages, response)
        self.items.move_to_end(rid)
        while len(self.items) > self.limit:
            self.items.popitem(last=False)

    def get(self, rid: str, param: str | None = None) -> tuple[list[dict], dict]:
        if rid not in self.items:
            where = "previous_response_id" if param else "the id"
            raise ApiError(
                404 if param is None else 400,
                f"no response {rid!r} is kept ({where}): this server keeps its last "
                f"{self.limit} responses in memory, and forgets them when it restarts",
                param=param,
                code="response_not_found" if param is None else None,
            )
        self.items.move_to_end(rid)
        return self.items[rid]


def _usage(u: dict | None) -> dict | None:
    if u is None:
        return None
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


class Answer:
    """One Response being built: its head (the request's settings) and its output items."""

    def __init__(self, req: ResponsesRequest, name: str):
        self.id, self.created = request_id("resp"), int(time.time())
        self.req, self.name = req, name
        self.output: list[dict] = []

    def message(self, text: str, status: str = "completed") -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {
            "type": "message",
            "id": request_id("msg"),
            "status": status,
            "role": "assistant",
            "content": [part] if text is not None else [],
        }

    def call(self, call: dict, status: str = "completed") -> dict:
        fn = call["function"]
        return {
            "type": "function_call",
            "id": request_id("fc"),
            "call_id": call["id"],
            "name": fn["name"],
            "arguments": fn["arguments"],
            "status": status,
        }

    def reasoning(self, text: str) -> dict:
        return {
            "type": "reasoning",
            "id": request_id("rs"),
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }

    def body(self, status: str, finish: str | None, usage: dict | None) -> dict:
        r = self.req
        cut = finish == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if cut and status == "completed" else status,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "error": None,
            "model": self.name,
            "output": self.output,
            "instructions": r.instructions,
            "previous_response_id": r.previous_response_id,
            "max_output_tokens": r.max_output_tokens,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "tool_choice": r.tool_choice or "auto",
            "tools": r.tools or [],
            "text": r.text or {"format": {"type": "text"}},
            "reasoning": r.reasoning,
            "truncation": r.truncation or "disabled",
            "store": r.store is not False,
            "metadata": r.metadata or {},
            "user": r.user,
            "usage": _usage(usage),
        }

    def from_chat(self, chat: dict) -> dict:
        """The whole Response of a finished chat completion."""
        choice = chat["choices"][0]
        msg = choice["message"]
        if msg.get("reasoning_content"):
            self.output.append(self.reasoning(msg["reasoning_content"]))
        if msg.get("content"):
            self.output.append(self.message(msg["content"]))
        for call in msg.get("tool_calls") or []:
            self.output.append(self.call(call))
        return self.body("completed", choice["finish_reason"], chat.get("usage"))

    def history(self, convo: list[dict]) -> list[dict]:
        """The conversation (instructions aside) and this answer, as chat messages: what a
        request continuing it (`previous_response_id`) starts from."""
        text = "".join(
            p["text"] for item in self.output if item["type"] == "message" for p in item["content"]
        )
        calls = [
            {
                "id": it["call_id"],
                "type": "function",
                "function": {"name": it["name"], "arguments": it["arguments"]},
            }
            for it in self.output
            if it["type"] == "function_call"
        ]
        turn: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            turn["tool_calls"] = calls
        return [*convo, turn]


async def events(answer: Answer, chunks: AsyncIterator[str], kept: Kept, convo: list[dict]):
    """The chat stream's chunks as the Responses API's events."""
    n = 0

    def event(kind: str, **fields) -> str:
        nonlocal n
        n += 1
        data = json.dumps({"type": kind, "sequence_number": n - 1, **fields}, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    yield event("response.created", response=answer.body("in_progress", None, None))
    yield event("response.in_progress", response=answer.body("in_progress", None, None))
    state = OpenItem(answer, event)
    finish, usage = None, None
    async with aclosing(chunks) as it:
        async for raw in it:
            data = raw.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                body = answer.body("failed", None, None)
                body["error"] = {
                    "code": chunk["error"].get("code") or "server_error",
                    "message": chunk["error"]["message"],
                }
                yield event("response.failed", response=body)
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                for out in state.feed(choice.get("delta", {})):
                    yield out
                finish = choice.get("finish_reason") or finish
    for out in state.close():
        yield out
    body = answer.body("completed", finish, usage)
    if answer.req.store is not False:
        kept.put(answer.id, answer.history(convo), body)
    kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
    yield event(kind, response=body)


class OpenItem:
    """The output item being streamed (a message, a function call, reasoning) and its events."""

    def __init__(self, answer: Answer, event):
        self.answer, self.event = answer, event
        self.item: dict | None = None
        self.calls: dict[int, dict] = {}  # chat's call index -> its function_call item

    def _start(self, item: dict) -> list[str]:
        out = self.close()
        self.item = item
        self.answer.output.append(item)
        i = len(self.answer.output) - 1
        out.append(self.event("response.output_item.added", output_index=i, item=item))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(
                self.part_event(
                    "response.content_part.added",
                    item["id"],
                    i,
                    part=part,
                )
            )
        return out

    def part_event(self, kind: str, item_id: str, i: int, **fields) -> str:
        """An event about content part 0 of output item i."""
        return self.event(kind, item_id=item_id, output_index=i, content_index=0, **fields)

    def _append(self, kind: str, make, event: str, text: str, **extra) -> list[str]:
        """`text` into the open item of `kind` (a new one from `make` if another is open),
        and its delta event."""
        same = self.item is not None and self.item["type"] == kind
        out = [] if same else self._start(make())
        self.item["content"][0]["text"] += text
        i = len(self.answer.output) - 1
        out.append(
            self.event(
                event, item_id=self.item["id"], output_index=i, content_index=0, delta=text, **extra
            )
        )
        return out

    def feed(self, delta: dict) -> list[str]:
        out: list[str] = []
        i = lambda: len(self.answer.output) - 1  # noqa: E731
        if delta.get("reasoning_content"):
            text, make = delta["reasoning_content"], lambda: self.answer.reasoning("")
            out += self._append("reasoning", make, "response.reasoning_text.delta", text)
        if delta.get("content"):
            make = lambda: self.answer.message("", "in_progress")  # noqa: E731
            out += self._append(
                "message", make, "response.output_text.delta", delta["content"], logprobs=[]
            )
        for call in delta.get("tool_calls") or []:
            if call.get("id"):
                item = self.answer.call(
                    {
                        "id": call["id"],
                        "function": {"name": call["function"]["name"], "arguments": ""},
                    },
                    "in_progress",
                )
                out += self._start(item)
                self.calls[call["index"]] = item
            piece = call.get("function", {}).get("arguments")
            if piece:
                item = self.calls[call["index"]]
                item["arguments"] += piece
                out.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=i(),
                        delta=piece,
                    )
                )
        return out

    def close(self) -> list[str]:
        """Events that end the open item."""
        item, self.item = self.item, None
        if item is None:
            return []
        i = self.answer.output.index(item)
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(
                self.part_event(
                    "response.output_text.done",
                    item["id"],
                    i,
                    text=part["text"],
                    logprobs=[],
                )
            )
            out.append(
                self.part_event(
                    "response.content_part.done",
                    item["id"],
                    i,
                    part=part,
                )
            )
        elif item["type"] == "function_call":
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=i,
                    arguments=item["arguments"],
                )
            )
        elif item["type"] == "reasoning":
            out.append(
                self.part_event(
                    "response.reasoning_text.done",
                    item["id"],
                    i,
                    text=item["content"][0]["text"],
                )
            )
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=i, item=item))
        return out
