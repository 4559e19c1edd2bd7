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

from core.generation import GenerationResult, TokenLogprob
from core.reasoning import Reasoner
from core.scheduler import Job
from core.server_schemas import Reply, as_api_error, error_body
from core.tool_calls import ToolUse, call_id


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


async def events(
    jobs: list[Job],
    reply: Reply,
    fmt: Callable,
    usage: bool,
    echo: str = "",
    tools: ToolUse | None = None,
    reasoner: Reasoner | None = None,
) -> AsyncIterator[str]:
    """The SSE stream of a request's jobs: per choice a chunk per text piece (with the logprobs
    of its tokens) and a last chunk with its finish_reason; then a usage chunk if asked, and
    [DONE]. `echo` (completions) is each choice's first text. With `tools`, text from where a
    call may start is held back; at the end each call goes out as OpenAI streams one: a delta
    with its index, id and name, then one with its arguments (or the held text as content, if
    it was no call); a named forced call's arguments stream as they are written. With a
    `reasoner`, thinking goes out as
    reasoning_content deltas (a harmony answer's, at its end)."""
    # a named forced call's answer is its arguments' JSON: streamed as argument deltas as written
    live = [None] * len(jobs) if tools and tools.forced and tools.named else None
    holds = [tools.hold() for _ in jobs] if tools and not live else None
    splits = [reasoner.stream() for _ in jobs] if reasoner else None
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
                if reasoner:
                    thought, value = splits[i].feed(value) if splits[i] else ("", "")
                    if thought:
                        yield sse(reply.chunk(None, reasoning=thought, index=i))
                    if not value:
                        continue
                if live:
                    if live[i] is None:  # the call's head: index, id, type, name
                        live[i] = call_id()
                        name = {"name": tools.named, "arguments": ""}
                        head = {"index": 0, "id": live[i], "type": "function", "function": name}
                        yield sse(reply.chunk(None, calls=[head], index=i))
                    args = {"index": 0, "function": {"arguments": value}}
                    yield sse(reply.chunk(None, lps, calls=[args], index=i))
                    pending[i], sent[i] = [], sent[i] + len(value)
                    continue
                if holds:
                    value = holds[i].feed(value)
                    if not value:
                        continue  # (its logprobs go out with the next text)
                yield sse(reply.chunk(value, lps, index=i))
                pending[i], sent[i] = [], sent[i] + len(value)
            elif kind == "error":
                yield sse(error_body(as_api_error(value)))
                break
            else:
                lps = fmt(pending[i], sent[i]) if pending[i] else None
                finish = value.finish_reason
                if reasoner:
                    if splits[i]:
                        thought, rest = splits[i].flush()
                    else:
                        thought, rest = reasoner.answer(value, value.text)
                    if thought:
                        yield sse(reply.chunk(None, reasoning=thought, index=i))
                    if rest and holds:
                        rest = holds[i].feed(rest)
                    if rest:
                        yield sse(reply.chunk(rest, index=i))
                if live and tools.answer(value)[1]:
                    finish = "tool_calls"  # (its arguments went out as they came)
                if holds:
                    _, calls = tools.answer(value)
                    for k, c in enumerate(calls or []):
                        name = {"name": c["function"]["name"], "arguments": ""}
                        head = {"index": k, "id": c["id"], "type": "function", "function": name}
                        args = {"index": k, "function": {"arguments": c["function"]["arguments"]}}
                        yield sse(reply.chunk(None, calls=[head], index=i))
                        yield sse(reply.chunk(None, calls=[args], index=i))
                    if calls:
                        finish = "tool_calls"
                    elif holds[i].held:
                        yield sse(reply.chunk(holds[i].held, lps, index=i))
                        lps = None
                text = None if reply.kind == "chat" else ""
                yield sse(reply.chunk(text, lps, finish=finish, index=i))
                done.append(value)
        else:
            if usage:
                yield sse(reply.usage_chunk(done))
    yield sse("[DONE]")
