"""`zoo serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one loaded model.

Handlers validate a request on the event loop, queue it as a `Job` for the scheduler thread
(core/serve/scheduler.py: it owns the model and batches requests continuously), and turn the job's
events into a JSON response or server-sent events. A client that disconnects cancels its row.
See docs/serve.md.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import time
from collections.abc import Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from core.chat.reasoning import Reasoner
from core.chat.tool_calls import ToolUse, family, template_arguments
from core.errors import RequestError, ZooError
from core.model import Model
from core.sampling import SamplingParams
from core.serve.metrics import CONTENT_TYPE, ServerMetrics
from core.serve.scheduler import Job, QueueFull, Scheduler
from core.serve.schemas import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    Reply,
    TokenizeRequest,
    as_api_error,
    chat_logprobs,
    completion_logprobs,
    error,
    error_body,
    model_list,
    validation_error,
)
from core.serve.stream import EventStream, Reading, events, results
from core.structured import schema_text

CHAT_PAGE = Path(__file__).parent / "static" / "chat.html"  # GET /
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait (Retry-After)


class _Auth:
    """ASGI middleware: /v1/* needs `Authorization: Bearer <key>` (before the body is read)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode(), self.key
            )
            if not ok:
                message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                body = error(message, code="invalid_api_key")
                return await JSONResponse(body, status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)


def _tool_use(req: ChatRequest, model: Model) -> ToolUse | None:
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


def _msg(e: dict) -> str:
    """A pydantic error's message without its "Value error, " prefix."""
    return e["msg"].removeprefix("Value error, ")


def _encoded(encode: Callable[[], list[int]], param: str) -> list[int]:
    """Prompt ids, or a 400 naming the request field whose text or ids are at fault."""
    try:
        return encode()
    except RequestError as err:
        raise ApiError(400, str(err), param=param) from None


def create_app(
    model: Model, name: str, *, api_key: str | None = None, max_queue: int | None = None
) -> FastAPI:
    """The FastAPI app serving `model` as `name`; batches hold up to model.max_batch_size, and
    at most `max_queue` requests wait (more: 503 with Retry-After)."""
    metrics = ServerMetrics(name)
    scheduler = Scheduler(model, metrics, max_queue)
    tok = model.tokenizer
    vocab = model.config.vocab_size
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="zoo", lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    if api_key:
        app.add_middleware(_Auth, key=api_key)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return JSONResponse(error_body(err), status_code=err.status)

    @app.exception_handler(ZooError)
    async def _zoo_error(request: Request, err: ZooError):
        return await _api_error(request, as_api_error(err))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        return await _api_error(request, validation_error(err))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException):
        return await _api_error(request, ApiError(err.status_code, str(err.detail)))

    def check(req) -> None:
        if req.model != name:
            message = f"the model '{req.model}' does not exist; this server has '{name}'"
            raise ApiError(404, message, param="model", code="model_not_found")
        if not 1 <= req.n <= model.max_batch_size:
            raise ApiError(
                400,
                f"n={req.n}: this server answers 1 to {model.max_batch_size} choices a request "
                "(its batch size); restart zoo serve with a larger --max-batch-size for more",
                param="n",
            )
        bad = [t for t in req.logit_bias or {} if not t.isdigit() or int(t) >= vocab]
        if bad:
            raise ApiError(
                400,
                f"logit_bias keys {bad[:5]} are not token ids of this model [0, {vocab})",
                param="logit_bias",
            )

    def prepare(
        req, ids: list[int], max_tokens: int | None, logprobs, names: dict, **extra
    ) -> list[Job]:
        """Context length and sampling values checked -> a Job per choice (n; choice i seeded
        with seed + i). `names` maps SamplingParams fields to the request's (for errors);
        `extra`: more SamplingParams fields (structured output)."""
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

    async def respond(
        jobs: list[Job],
        req,
        request: Request,
        reply: Reply,
        fmt,
        echo: str = "",
        reading: Reading | None = None,
    ):
        """Queue a request's jobs (one per choice, together) and answer when they are done, or
        stream them."""
        try:
            for job in jobs:
                scheduler.submit(job)
        except QueueFull as err:
            for job in jobs:
                job.cancelled = True  # those already queued never run
            body = error_body(ApiError(503, f"the server is busy: {err}; retry shortly"))
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            reply.include_usage = usage
            return EventStream(jobs, events(jobs, reply, fmt, usage, echo, reading))
        done = await results(jobs, request)
        lps = [fmt(r.logprobs, len(echo)) if r.logprobs is not None else None for r in done]
        answers = [reading.whole(r) for r in done] if reading else None
        return JSONResponse(reply.full(done, lps, echo, answers))

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        """The chat page: one static file that talks to this server's own API."""
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health():
        """ok, and the requests holding a row (running) and queued for one (waiting)."""
        return {"status": "ok", "running": len(scheduler.running), "waiting": scheduler.queued}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return model_list(name, model.max_seq_len, created)

    def template_messages(given) -> list[dict]:
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
            for call in msg.get("tool_calls") or []:
                f = call.get("function", {}) if isinstance(call, dict) else {}
                if isinstance(f.get("arguments"), str):
                    try:
                        f["arguments"] = template_arguments(f["arguments"])
                    except json.JSONDecodeError:
                        where = f"messages.{i}.tool_calls"
                        raise ApiError(
                            400, f"{where}: arguments are not JSON", param=where
                        ) from None
            messages.append(msg)
        if tok is None:
            raise RequestError(f"{model.path} has no tokenizer; use /v1/completions with ids")
        return messages

    def check_name(given: str | None) -> None:
        if given is not None and given != name:
            message = f"the model '{given}' does not exist; this server has '{name}'"
            raise ApiError(404, message, param="model", code="model_not_found")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        """vLLM's: the ids a completion (prompt) or chat (messages) request would run."""
        check_name(req.model)
        if req.messages is not None:
            messages = template_messages(req.messages)
            render = lambda: tok.apply_chat_template(messages, req.add_generation_prompt)  # noqa: E731
            ids = _encoded(render, "messages")
        elif tok is None:
            raise RequestError(f"{model.path} has no tokenizer to encode a prompt with")
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": model.max_seq_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        """vLLM's: the text of token ids, special tokens kept."""
        check_name(req.model)
        ids = _encoded(lambda: model.encode_prompt(req.tokens), "tokens")  # checks the vocab
        if tok is None:
            raise RequestError(f"{model.path} has no tokenizer to decode with")
        return {"prompt": tok.decode(ids, skip_special_tokens=False)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        check(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        messages = template_messages(req.messages)
        tools = _tool_use(req, model)
        extra = dict(req.chat_template_kwargs or {})
        taken = sorted({"messages", "add_generation_prompt", "tools"} & set(extra))
        if taken:
            message = f"chat_template_kwargs cannot set {taken}: they are the request's own"
            raise ApiError(400, message, param="chat_template_kwargs")
        if tools:  # as transformers and vLLM hand them to templates
            extra["tools"] = [{"type": "function", "function": t} for t in tools.tools]
        # the template writes the special tokens; encode_prompt checks the ids against the vocab
        render = lambda: tok.apply_chat_template(messages, **extra)  # noqa: E731
        ids = _encoded(lambda: model.encode_prompt(render()), "messages")
        newer = req.max_completion_tokens is not None  # max_tokens' newer name wins
        names = {"max_new_tokens": "max_completion_tokens" if newer else "max_tokens"}
        max_tokens = req.max_completion_tokens if newer else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        names = {**names, "logprobs": "top_logprobs"}
        names["json_schema"] = "response_format.json_schema.schema"
        structure = tools.structure() if tools else req.structure()
        reasoner = Reasoner.for_request(tok, ids)
        structure.update(reasoner.params() if reasoner else {})
        jobs = prepare(req, ids, max_tokens, logprobs, names, **structure)
        fmt = lambda lps, _offset: chat_logprobs(tok, lps)  # noqa: E731
        reading = Reading(reasoner, tools) if reasoner or tools else None
        reply = Reply("chat", name)
        return await respond(jobs, req, request, reply, fmt, reading=reading)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request (got a list of them)", param="prompt")
            prompt = prompt[0]
        if req.echo and req.logprobs is not None:
            message = "echo with logprobs (the prompt's log-probabilities) is not supported"
            raise ApiError(400, message, param="echo")
        ids = _encoded(lambda: model.encode_prompt(prompt), "prompt")
        jobs = prepare(req, ids, req.max_tokens, req.logprobs, {"max_new_tokens": "max_tokens"})
        fmt = lambda lps, offset: completion_logprobs(tok, lps, offset)  # noqa: E731
        echo = ""
        if req.echo:  # the prompt's own text (ids: decoded as they are, special tokens kept)
            echo = prompt if isinstance(prompt, str) else tok.decode(ids, False) if tok else ""
        return await respond(jobs, req, request, Reply("completion", name), fmt, echo)

    return app


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free one); one that cannot be bound raises RequestError,
    before a model is loaded for nothing."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as err:
        raise RequestError(
            f"cannot listen on {host}:{port} ({err.strerror or err}); pick another --port"
        ) from None


def serve(
    model: Model,
    name: str,
    sock: socket.socket,
    *,
    api_key: str | None = None,
    max_queue: int | None = None,
) -> None:
    """Serve `model` as `name` on a socket from `listen` until Ctrl-C."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    print(
        f"zoo: serving {name} at http://{host}:{port}/v1 (batches of up to "
        f"{model.max_batch_size}, context {model.max_seq_len} tokens)",
        flush=True,
    )
    app = create_app(model, name, api_key=api_key, max_queue=max_queue)
    with suppress(KeyboardInterrupt):  # uvicorn re-raises Ctrl-C after a clean stop
        uvicorn.Server(uvicorn.Config(app, log_level="info")).run(sockets=[sock])
