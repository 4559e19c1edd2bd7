"""`zoo serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one loaded model.

Handlers (module-level routes of `router`, the served model and its scheduler on
`app.state.zoo`) validate a request on the event loop, queue it as a `Job` for the scheduler thread
(core/serve/scheduler.py: it owns the model and batches requests continuously), and turn the job's
events into a JSON response or server-sent events. A client that disconnects cancels its row.
See docs/serve.md.
"""

from __future__ import annotations

import hmac
import socket
import time
from contextlib import asynccontextmanager, suppress
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from core.chat.reasoning import Reasoner
from core.errors import RequestError, ZooError
from core.model import Model
from core.serve import embeddings, responses
from core.serve.embeddings import resolve_task
from core.serve.metrics import CONTENT_TYPE, ServerMetrics
from core.serve.requests import (
    Served,
    check,
    check_name,
    encoded,
    prepare_jobs,
    shown_tools,
    submit,
    template_messages,
    tool_use,
)
from core.serve.scheduler import Job, Scheduler
from core.serve.schemas import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Reply,
    TokenizeRequest,
    as_api_error,
    chat_logprobs,
    completion_logprobs,
    error,
    error_body,
    model_card,
    model_list,
    validation_error,
)
from core.serve.stream import EventStream, Reading, events, results

CHAT_PAGE = Path(__file__).parent / "static" / "chat.html"  # GET /
FAVICON = Path(__file__).parent / "static" / "favicon.svg"  # GET /favicon.ico (browsers ask)


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


def _served(request: Request) -> Served:
    return request.app.state.zoo


router = APIRouter()


def create_app(
    model: Model,
    name: str,
    *,
    api_key: str | None = None,
    max_queue: int | None = None,
    task: str | None = None,
) -> FastAPI:
    """The FastAPI app serving `model` as `name`; batches hold up to model.max_batch_size, and
    at most `max_queue` requests wait (more: 503 with Retry-After). `task`: "embed" serves
    /v1/embeddings too; None: "embed" for a checkpoint with sentence-transformers files."""
    task = resolve_task(task, model)
    metrics = ServerMetrics(name)
    scheduler = Scheduler(model, metrics, max_queue)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="zoo", lifespan=lifespan)
    app.state.zoo = Served(model, name, scheduler, metrics, int(time.time()), task)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    if api_key:
        app.add_middleware(_Auth, key=api_key)
    for kind, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(kind, handler)
    app.state.responses = responses.Kept()  # for previous_response_id
    app.include_router(router)
    app.include_router(responses.router)  # GET / DELETE /v1/responses/{id}
    app.include_router(embeddings.router)
    return app


async def _api_error(request: Request, err: ApiError):
    return JSONResponse(error_body(err), status_code=err.status)


async def _zoo_error(request: Request, err: ZooError):
    return await _api_error(request, as_api_error(err))


async def _invalid(request: Request, err: RequestValidationError):
    return await _api_error(request, validation_error(err))


async def _http_error(request: Request, err: HTTPException):
    return await _api_error(request, ApiError(err.status_code, str(err.detail)))


ERROR_HANDLERS = {
    ApiError: _api_error,
    ZooError: _zoo_error,
    RequestValidationError: _invalid,
    HTTPException: _http_error,
}


async def _respond(
    s: Served,
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
    busy = submit(s, jobs)
    if busy is not None:
        return busy
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        reply.include_usage = usage
        return EventStream(jobs, events(jobs, reply, fmt, usage, echo, reading))
    done = await results(jobs, request)
    lps = [fmt(r.logprobs, len(echo)) if r.logprobs is not None else None for r in done]
    answers = [reading.whole(r) for r in done] if reading else None
    return JSONResponse(reply.full(done, lps, echo, answers))


@router.get("/", response_class=HTMLResponse)
async def chat_page():
    """The chat page: one static file that talks to this server's own API."""
    return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))


@router.get("/favicon.ico", include_in_schema=False)
async def favicon():
    """The page's icon, an SVG (browsers take one by its content type at this address too)."""
    return Response(
        FAVICON.read_bytes(), media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"}
    )


@router.get("/health")
async def health(request: Request):
    """ok, and the requests holding a row (running) and queued for one (waiting)."""
    scheduler = _served(request).scheduler
    return {"status": "ok", "running": len(scheduler.running), "waiting": scheduler.queued}


@router.get("/metrics")
async def prometheus(request: Request):
    return Response(_served(request).metrics.exposition(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def models(request: Request):
    s = _served(request)
    return model_list(s.name, s.model.max_seq_len, s.created)


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request):
    """The served model's object (as /v1/models lists it); another id: 404 model_not_found."""
    s = _served(request)
    if model_id != s.name:
        message = f"the model '{model_id}' does not exist; this server has '{s.name}'"
        raise ApiError(404, message, param="model", code="model_not_found")
    return model_card(s.name, s.model.max_seq_len, s.created)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request):
    """vLLM's: the ids a completion (prompt) or chat (messages) request would run."""
    s = _served(request)
    check_name(s, req.model)
    if req.messages is not None:
        messages = template_messages(s, req.messages)
        render = lambda: s.tok.apply_chat_template(messages, req.add_generation_prompt)  # noqa: E731
        ids = encoded(render, "messages")
    elif s.tok is None:
        raise RequestError(f"{s.model.path} has no tokenizer to encode a prompt with")
    else:
        ids = s.tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": s.model.max_seq_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request):
    """vLLM's: the text of token ids, special tokens kept."""
    s = _served(request)
    check_name(s, req.model)
    ids = encoded(lambda: s.model.encode_prompt(req.tokens), "tokens")  # checks the vocab
    if s.tok is None:
        raise RequestError(f"{s.model.path} has no tokenizer to decode with")
    return {"prompt": s.tok.decode(ids, skip_special_tokens=False)}


@router.post("/v1/chat/completions")
async def chat(req: ChatRequest, request: Request):
    s = _served(request)
    tok = s.tok
    check(s, req)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    messages = template_messages(s, req.messages)
    tools = tool_use(req, s.model)
    extra = dict(req.chat_template_kwargs or {})
    taken = sorted({"messages", "add_generation_prompt", "tools"} & set(extra))
    if taken:
        message = f"chat_template_kwargs cannot set {taken}: they are the request's own"
        raise ApiError(400, message, param="chat_template_kwargs")
    if tools:  # as transformers and vLLM hand them to templates (or in the generic form)
        messages = shown_tools(s, messages, tools, extra)
        extra["tools"] = [{"type": "function", "function": t} for t in tools.tools]
    # the template writes the special tokens; encode_prompt checks the ids against the vocab
    render = lambda: tok.apply_chat_template(messages, **extra)  # noqa: E731
    ids = encoded(lambda: s.model.encode_prompt(render()), "messages")
    newer = req.max_completion_tokens is not None  # max_tokens' newer name wins
    names = {"max_new_tokens": "max_completion_tokens" if newer else "max_tokens"}
    max_tokens = req.max_completion_tokens if newer else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    names = {**names, "logprobs": "top_logprobs"}
    names["json_schema"] = "response_format.json_schema.schema"
    structure = tools.structure() if tools else req.structure()
    reasoner = Reasoner.for_request(tok, ids)
    structure.update(reasoner.params() if reasoner else {})
    jobs = prepare_jobs(s, req, ids, max_tokens, logprobs, names, **structure)
    fmt = lambda lps, _offset: chat_logprobs(tok, lps)  # noqa: E731
    reading = Reading(reasoner, tools) if reasoner or tools else None
    reply = Reply("chat", s.name)
    return await _respond(s, jobs, req, request, reply, fmt, reading=reading)


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    s = _served(request)
    tok = s.tok
    check(s, req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, "one prompt per request (got a list of them)", param="prompt")
        prompt = prompt[0]
    if req.echo and req.logprobs is not None:
        message = "echo with logprobs (the prompt's log-probabilities) is not supported"
        raise ApiError(400, message, param="echo")
    ids = encoded(lambda: s.model.encode_prompt(prompt), "prompt")
    jobs = prepare_jobs(s, req, ids, req.max_tokens, req.logprobs, {"max_new_tokens": "max_tokens"})
    fmt = lambda lps, offset: completion_logprobs(tok, lps, offset)  # noqa: E731
    echo = ""
    if req.echo:  # the prompt's own text (ids: decoded as they are, special tokens kept)
        echo = prompt if isinstance(prompt, str) else tok.decode(ids, False) if tok else ""
    return await _respond(s, jobs, req, request, Reply("completion", s.name), fmt, echo)


@router.post("/v1/responses")
async def create_response(req: responses.ResponsesRequest, request: Request):
    """OpenAI's Responses API, run as a chat completion (core/serve/responses.py)."""
    return await responses.create(req, request, chat)


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
    task: str | None = None,
) -> None:
    """Serve `model` as `name` on a socket from `listen` until Ctrl-C."""
    import uvicorn

    app = create_app(model, name, api_key=api_key, max_queue=max_queue, task=task)
    host, port = sock.getsockname()[:2]
    what = f"embeddings: {model.pooling.describe()}; " if app.state.zoo.task == "embed" else ""
    print(
        f"zoo: serving {name} at http://{host}:{port}/v1 ({what}batches of up to "
        f"{model.max_batch_size}, context {model.max_seq_len} tokens)",
        flush=True,
    )
    with suppress(KeyboardInterrupt):  # uvicorn re-raises Ctrl-C after a clean stop
        uvicorn.Server(uvicorn.Config(app, log_level="info")).run(sockets=[sock])
