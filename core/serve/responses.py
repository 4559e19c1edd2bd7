"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`) over the
chat path: a request's `instructions`, `input` items (messages, `function_call`,
`function_call_output`), function `tools`, `tool_choice` and `text.format` become a chat
completions request, run as one (the same validation, template, tool-call formats, grammar and
scheduler), and its answer becomes a Response object, or its stream of chunks becomes the
Responses API's typed events. `previous_response_id` continues a conversation kept in memory
(the last 256 responses, `response_items.MAX_KEPT`; a restart forgets them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from core.serve.response_items import Answer, Kept, ResponsesRequest, events
from core.serve.schemas import ApiError, ChatRequest
from core.serve.stream import EventStream

router = APIRouter()


def _text(content: Any, index: int) -> str:
    """An input message's content: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise ApiError(
                    400,
                    f"input[{index}]: content parts of type {kind!r} are not supported (text only)",
                    param=f"input[{index}].content",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ApiError(
        400,
        f"input[{index}].content must be a string or a list of text parts",
        param=f"input[{index}].content",
    )


def _messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """The request's `input` as chat messages; consecutive function calls are one assistant
    turn, as chat templates show them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(
                    400,
                    f"input[{i}].role {role!r} is not one of user, assistant, system, developer",
                    param=f"input[{i}].role",
                )
            role = "system" if role == "developer" else role
            out.append({"role": role, "content": _text(item.get("content", ""), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments", "")}
            last = out[-1] if out else None
            if last and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            output = output if isinstance(output, str) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind != "reasoning":  # (a reasoning item of an earlier answer: not shown again)
            raise ApiError(
                400,
                f"input[{i}]: items of type {kind!r} are not supported "
                "(message, function_call, function_call_output)",
                param=f"input[{i}].type",
            )
    return out


def _chat_fields(req: ResponsesRequest) -> dict[str, Any]:
    """The chat request's tools, tool choice and response format."""
    out: dict[str, Any] = {}
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function":
                raise ApiError(
                    400,
                    f"tools[{i}]: only function tools are supported (got {t.get('type')!r})",
                    param=f"tools[{i}].type",
                )
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
            tools.append({"type": "function", "function": fn})
        out["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    if req.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = (req.text or {}).get("format")
    if fmt and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt and fmt.get("type") in ("json_object", "text"):
        out["response_format"] = {"type": fmt["type"]}
    elif fmt:
        raise ApiError(
            400,
            f"text.format.type {fmt.get('type')!r} is not text, json_object or json_schema",
            param="text.format",
        )
    return out


async def create(req: ResponsesRequest, request: Request, chat: Callable) -> Response:
    """POST /v1/responses (routed in core/serve/app.py): run as the chat request `chat` takes."""
    kept: Kept = request.app.state.responses
    convo = []
    if req.previous_response_id is not None:
        convo = kept.get(req.previous_response_id, "previous_response_id")[0]
    convo = convo + _messages(req.input)
    if not convo:
        raise ApiError(400, "input is empty: give a string or at least one item", param="input")
    system = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    fields = dict(model=req.model, messages=system + convo, stream=req.stream)
    fields.update(max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p)
    fields.update(_chat_fields(req))
    if req.stream:
        fields["stream_options"] = {"include_usage": True}
    answer = Answer(req, request.app.state.zoo.name)
    reply = await chat(ChatRequest.model_validate(fields), request)
    if not isinstance(reply, EventStream):
        if reply.status_code != 200:  # (a full queue's 503)
            return reply
        body = answer.from_chat(json.loads(reply.body))
        if req.store is not False:
            kept.put(answer.id, answer.history(convo), body)
        return JSONResponse(body)
    return EventStream(reply.jobs, events(answer, reply.body_iterator, kept, convo))


@router.get("/v1/responses/{rid}")
async def retrieve(rid: str, request: Request):
    return JSONResponse(request.app.state.responses.get(rid)[1])


@router.delete("/v1/responses/{rid}")
async def delete(rid: str, request: Request):
    kept: Kept = request.app.state.responses
    kept.get(rid)
    del kept.items[rid]
    return {"id": rid, "object": "response", "deleted": True}
