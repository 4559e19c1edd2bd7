"""How `zoo serve` waits for its jobs: a request's n choices are n jobs (rows); their events
become one JSON answer (`results`) or one stream of server-sent events (`events`), choice by
choice as OpenAI streams them. A client that goes away cancels all of its rows."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import StreamingResponse

from core.chat.reasoning import Reasoner, read_whole, reader
from core.chat.tool_calls import ToolUse, call_id
from core.generation import GenerationResult, TokenLogprob
from core.serve.scheduler import Job
from core.serve.schemas import Reply, as_api_error, error_body


class EventStream(StreamingResponse):
    """Server-sent events that cancel their jobs however the response ends (a client that went
    away frees its rows now, not when the generator is garbage-collected)."""

    def __init__(self, jobs: list[Job], events: AsyncIterator[str]):
        super().__init__(events, media_type="text/event-stream")
        self.jobs = jobs

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                job.cancelled = True  # no-op once the job is done
            await self.body_iterator.aclose()


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def _cancel_on_disconnect(request: Request, jobs: list[Job]) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
        job.cancelled = True


async def _tagged(jobs: list[Job]) -> AsyncIterator[tuple[int, str, object]]:
    """(choice index, kind, value) of every job's events, as they come, until each has ended."""
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(index: int, job: Job) -> None:
        while True:
            kind, value = await job.events.get()
            await merged.put((index, kind, value))
            if kind in ("done", "error"):
                return

    tasks = [asyncio.create_task(forward(i, job)) for i, job in enumerate(jobs)]
    ended = 0
    try:
        while ended < len(jobs):
            index, kind, value = await merged.get()
            yield index, kind, value
            ended += kind in ("done", "error")
    finally:
        for task in tasks:
            task.cancel()


async def results(jobs: list[Job], request: Request) -> list[GenerationResult]:
    """Wait for non-streaming jobs; cancel their rows if the client disconnects meanwhile."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, jobs))
    out: list[GenerationResult | None] = [None] * len(jobs)
    try:
        async with aclosing(_tagged(jobs)) as tagged:
            async for index, kind, value in tagged:
                if kind == "done":
                    out[index] = value
                elif kind == "error":
                    raise as_api_error(value)
        return out
    finally:
        watcher.cancel()
        for job in jobs:
            job.cancelled = True  # no-op once done; frees the rows if this handler was cancelled


class Reading:
    """How a chat request's answers are read: its model's reasoning (a think block, gpt-oss's
    channels) and its tools' calls; a fresh reader per choice (`reader`)."""

    def __init__(self, reasoner: Reasoner | None, tools: ToolUse | None):
        self.reasoner, self.tools = reasoner, tools

    def reader(self):
        return reader(self.reasoner, self.tools)

    def call_id(self) -> str:
        return call_id(self.tools.fam if self.tools else None)

    def whole(self, result: GenerationResult) -> tuple[str | None, list[dict] | None, str | None]:
        """(content, tool_calls, reasoning) of a finished answer: what its stream would say."""
        cut = result.finish_reason == "length"
        content, calls, thought = read_whole(self.reader(), result.text, cut)
        tool_calls = [
            {"id": self.call_id(), "type": "function", "function": {"name": n, "arguments": a}}
            for n, a in calls
        ]
        if tool_calls:
            return content or None, tool_calls, thought if self.reasoner else None
        return content, None, thought if self.reasoner else None


def _chunks(reply: Reply, deltas: list, i: int, lps, ids: dict[int, str], reading: Reading):
    """A reader's deltas as stream chunks of choice i (the logprobs ride on the first); a call
    goes out as OpenAI streams one: a head with its index, id, type and name (arguments ""),
    then pieces of its arguments."""
    for kind, text, k in deltas:
        if kind == "content":
            yield sse(reply.chunk(text, lps, index=i))
        elif kind == "reasoning":
            yield sse(reply.chunk(None, lps, reasoning=text, index=i))
        elif kind == "call":
            ids[k] = reading.call_id()
            head = {"index": k, "id": ids[k], "type": "function"}
            head["function"] = {"name": text, "arguments": ""}
            yield sse(reply.chunk(None, lps, calls=[head], index=i))
        else:
            args = {"index": k, "function": {"arguments": text}}
            yield sse(reply.chunk(None, lps, calls=[args], index=i))
        lps = None


async def events(
    jobs: list[Job],
    reply: Reply,
    fmt: Callable,
    usage: bool,
    echo: str = "",
    reading: Reading | None = None,
) -> AsyncIterator[str]:
    """The SSE stream of a request's jobs: per choice a chunk per text piece (with the logprobs
    of its tokens) and a last chunk with its finish_reason; then a usage chunk if asked, and
    [DONE]. `echo` (completions) is each choice's first text. With a `reading` (a chat
    request's reasoning and tools), each piece goes through the choice's reader: thinking as
    reasoning_content deltas, tool calls as OpenAI streams them (see `_chunks`), text that may
    still be a call's marker held back until the reader can tell."""
    readers = [reading.reader() for _ in jobs] if reading else None
    ids: list[dict[int, str]] = [{} for _ in jobs]
    for i in range(len(jobs)):
        if reply.kind == "chat":
            yield sse(reply.chunk("", role=True, index=i))
        elif echo:
            yield sse(reply.chunk(echo, index=i))
    pending: list[list[TokenLogprob]] = [[] for _ in jobs]
    sent = [len(echo)] * len(jobs)
    done: list[GenerationResult] = []
    async with aclosing(_tagged(jobs)) as tagged:
        async for i, kind, value in tagged:
            if kind == "token":
                pending[i].append(value)
            elif kind == "text":
                lps = fmt(pending[i], sent[i]) if pending[i] else None
                if readers:
                    deltas = readers[i].feed(value)
                    if not deltas:
                        continue  # (its logprobs go out with the next text)
                    for chunk in _chunks(reply, deltas, i, lps, ids[i], reading):
                        yield chunk
                else:
                    yield sse(reply.chunk(value, lps, index=i))
                pending[i], sent[i] = [], sent[i] + len(value)
            elif kind == "error":
                yield sse(error_body(as_api_error(value)))
                break
            else:
                lps = fmt(pending[i], sent[i]) if pending[i] else None
                finish = value.finish_reason
                if readers:
                    for chunk in _chunks(reply, readers[i].finish(), i, lps, ids[i], reading):
                        lps = None
                        yield chunk
                    # max_tokens' cut is "length", even after whole calls (as OpenAI)
                    if readers[i].calls and readers[i].complete() and finish != "length":
                        finish = "tool_calls"
                text = None if reply.kind == "chat" else ""
                yield sse(reply.chunk(text, lps, finish=finish, index=i))
                done.append(value)
        else:
            if usage:
                yield sse(reply.usage_chunk(done))
    yield sse("[DONE]")
