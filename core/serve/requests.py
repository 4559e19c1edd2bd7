"""What a request asks, checked before it runs: the model it names, its n and logit_bias, its
prompt within the context, its sampling values (400s naming the request's own fields), its tools
and tool_choice, its chat messages as the template takes them; then one `Job` per choice."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from core.chat.harmony import is_harmony
from core.chat.tool_calls import ToolUse, detected, family, template_arguments
from core.chat.tool_formats import generic
from core.errors import ChatTemplateError, RequestError
from core.model import Model
from core.sampling import SamplingParams
from core.serve.metrics import ServerMetrics
from core.serve.scheduler import Job, QueueFull, Scheduler
from core.serve.schemas import ApiError, ChatRequest, NamedToolChoice, error_body
from core.structured import schema_text


@dataclass
class Served:
    """What the handlers serve (`app.state.zoo`): the model under its name, the scheduler that
    runs its requests, the metrics they feed, and when the server started."""

    model: Model
    name: str
    scheduler: Scheduler
    metrics: ServerMetrics
    created: int
    task: str = "generate"  # "embed": /v1/embeddings is served too (zoo serve --task)

    @property
    def tok(self):
        return self.model.tokenizer


def tool_use(req: ChatRequest, model: Model) -> ToolUse | None:
    """The request's tools and tool_choice checked (400s name the field) -> a ToolUse, or None
    when no tool may be called."""
    tools = [t.function.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        choice = choice.function.name
        if choice not in {t["name"] for t in tools}:
            known = ", ".join(t["name"] for t in tools) or "none given"
            message = f"tool_choice names '{choice}', which is not among the tools ({known})"
            raise ApiError(400, message, param="tool_choice")
    elif choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise ApiError(400, f"tool_choice '{choice}' needs tools", param="tool_choice")
    for i, t in enumerate(tools):
        if "parameters" in t:
            try:
                t["parameters"] = json.loads(schema_text(t["parameters"]))
            except ValueError as err:
                raise ApiError(400, str(err), param=f"tools.{i}.function.parameters") from None
    if choice == "none":
        return None
    if choice != "auto" and req.response_format is not None:
        message = "response_format cannot be combined with a forced tool call (tool_choice)"
        raise ApiError(400, message, param="response_format")
    fam, parallel = family(model.tokenizer.chat_template), req.parallel_tool_calls is not False
    return ToolUse(tools, choice, fam, parallel)


def shown_tools(s: Served, messages: list[dict], tools: ToolUse, extra: dict) -> list[dict]:
    """The messages to render with `tools`: as given when the chat template writes the tools
    (or teaches a call format of its own: DeepSeek-V3's writes none, gpt-oss's harmony is read
    by its own reader); else, when rendering with
    and without them gives the same prompt, in the generic form (core/chat/tool_formats/
    generic.py: the tools described in a system message, answers read by its grammar), never
    silently without them."""
    tok = s.tok
    if detected(tok.chat_template) is not None or is_harmony(tok):
        return messages
    shown = [{"type": "function", "function": t} for t in tools.tools]
    probe = [{**m, "content": m.get("content") or ""} for m in messages]  # (a null: empty)
    with_tools = encoded(lambda: tok.render_chat(probe, **extra, tools=shown), "messages")
    if with_tools != encoded(lambda: tok.render_chat(probe, **extra), "messages"):
        return messages
    tools.fam = generic.NAME
    return generic.conversation(messages, tools.tools)


def _msg(e: dict) -> str:
    """A pydantic error's message without its "Value error, " prefix."""
    return e["msg"].removeprefix("Value error, ")


def encoded(encode: Callable[[], list[int]], param: str) -> list[int]:
    """Prompt ids, or a 400 naming the request field whose text or ids are at fault."""
    try:
        return encode()
    except ChatTemplateError as err:
        at = param if err.index is None else f"{param}.{err.index}"
        raise ApiError(400, str(err), param=at) from None
    except RequestError as err:
        raise ApiError(400, str(err), param=param) from None


RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait (Retry-After)


def submit(s: Served, jobs: list) -> JSONResponse | None:
    """Queue a request's jobs together; when the queue is full, none of them runs and the
    answer is this 503 (with Retry-After)."""
    try:
        for job in jobs:
            s.scheduler.submit(job)
    except QueueFull as err:
        for job in jobs:
            job.cancelled = True  # those already queued never run
        body = error_body(ApiError(503, f"the server is busy: {err}; retry shortly"))
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    return None


def check(s: Served, req) -> None:
    if req.model != s.name:
        message = f"the model '{req.model}' does not exist; this server has '{s.name}'"
        raise ApiError(404, message, param="model", code="model_not_found")
    if not 1 <= req.n <= s.model.max_batch_size:
        raise ApiError(
            400,
            f"n={req.n}: this server answers 1 to {s.model.max_batch_size} choices a request "
            "(its batch size); restart zoo serve with a larger --max-batch-size for more",
            param="n",
        )
    vocab = s.model.config.vocab_size
    bad = [t for t in req.logit_bias or {} if not t.isdigit() or int(t) >= vocab]
    if bad:
        raise ApiError(
            400,
            f"logit_bias keys {bad[:5]} are not token ids of this model [0, {vocab})",
            param="logit_bias",
        )


def prepare_jobs(
    s: Served, req, ids: list[int], max_tokens: int | None, logprobs, names: dict, **extra
) -> list[Job]:
    """Context length and sampling values checked -> a Job per choice (n; choice i seeded
    with seed + i). `names` maps SamplingParams fields to the request's (for errors);
    `extra`: more SamplingParams fields (structured output)."""
    model = s.model
    room = model.max_seq_len - len(ids)
    # as vLLM: a max_tokens past the room is refused, not clipped (no max_tokens: the room)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = f" + {names['max_new_tokens']} ({max_tokens})" if room >= 1 else ""
        left = f": {room} tokens are left for the answer" if room >= 1 else ""
        raise ApiError(
            400,
            f"prompt ({len(ids)} tokens){asked} exceeds the context length "
            f"({model.max_seq_len} tokens){left}; shorten the prompt, ask for fewer tokens, "
            "or restart zoo serve with a larger --max-seq-len",
            param=names["max_new_tokens"] if room >= 1 else None,
            code="context_length_exceeded",
        )
    # OpenAI's default temperature is 1; the model's generation_config.json wins over it
    fields = {"temperature": 1.0, **model.defaults, **req.sampling(), "logprobs": logprobs}
    fields.update(extra)
    # no max_tokens: up to the rest of the context (as OpenAI and vLLM)
    default_max = min(model.defaults.get("max_new_tokens", room), room)
    fields["max_new_tokens"] = default_max if max_tokens is None else max_tokens
    try:
        params = SamplingParams(**fields)
    except ValidationError as err:
        e = err.errors()[0]
        key = str(e["loc"][0]) if e["loc"] else None
        param = names.get(key, key)
        raise ApiError(
            400, f"invalid '{param}': {_msg(e)} (got {e.get('input')!r})", param=param
        ) from None
    choices = [params] * req.n
    if params.seed is not None and req.n > 1:
        choices = [params.model_copy(update={"seed": params.seed + i}) for i in range(req.n)]
    loop = asyncio.get_running_loop()
    return [Job(ids, p, stream=req.stream, loop=loop) for p in choices]


def template_messages(s: Served, given) -> list[dict]:
    """Chat messages as the template takes them (content parts joined: text only; a tool
    call's arguments as an object, as templates write them with `tojson`, that joins to
    strings as its JSON text, as DeepSeek's templates join it)."""
    messages = []
    for i, m in enumerate(given):
        msg = m.model_dump(exclude_none=True)
        if msg.get("tool_calls") and "content" not in msg:
            msg["content"] = None  # (DeepSeek's templates test `content is none`)
        if isinstance(m.content, list):
            if any(part.type != "text" for part in m.content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            msg["content"] = "".join(part.text or "" for part in m.content)
        calls = msg.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
        ):
            where = f"messages.{i}.tool_calls"
            message = (
                f"{where} must be a list of calls, each {{id, type, function: {{name, arguments}}}}"
            )
            raise ApiError(400, message, param=where)
        for call in calls or []:
            f = call.get("function")
            if isinstance(f, dict) and isinstance(f.get("arguments"), str):
                try:
                    f["arguments"] = template_arguments(f["arguments"])
                except json.JSONDecodeError:
                    where = f"messages.{i}.tool_calls"
                    raise ApiError(400, f"{where}: arguments are not JSON", param=where) from None
        messages.append(msg)
    if s.tok is None:
        raise RequestError(f"{s.model.path} has no tokenizer; use /v1/completions with ids")
    return messages


def check_name(s: Served, given: str | None) -> None:
    if given is not None and given != s.name:
        message = f"the model '{given}' does not exist; this server has '{s.name}'"
        raise ApiError(404, message, param="model", code="model_not_found")
