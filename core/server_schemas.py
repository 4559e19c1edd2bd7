"""The OpenAI API's request bodies (pydantic), its error object, and the JSON objects
`core.server` answers with.

Requests ignore fields they do not know (clients send `user`, `store`, `tools`...); sampling
values are range-checked once, by `SamplingParams` (core/server.py names the request's field).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.errors import ZooError
from core.generation import GenerationResult, TokenLogprob
from core.scheduler import Cancelled, ShuttingDown
from core.tokenizer import Tokenizer


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extra sampling fields (openai client: extra_body={...})
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None

    def sampling(self) -> dict[str, Any]:
        """SamplingParams fields this request sets (max_new_tokens and logprobs aside)."""
        keys = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty")
        keys += ("top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids")
        out = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if out.get("top_k") == -1:  # vLLM's spelling of "off"
            out["top_k"] = 0
        return out


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, name...: passed to the template

    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins over it
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text `prompt` (special tokens added by default) or chat `messages`
    (rendered by the model's template, which writes its own special tokens)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for a prompt
    add_generation_prompt: bool = True  # for messages

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids -> their text (special tokens kept)."""

    model: str | None = None
    tokens: list[int]


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # top-n alternatives per token
    echo: bool = False


# --- errors --------------------------------------------------------------------------------
def error(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ApiError(Exception):
    """A request the server refuses: answered with `status` and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def as_api_error(err: Exception) -> ApiError:
    """What a handler, the scheduler or the model raised -> its answer (5xx: the server's fault)."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, ShuttingDown):
        return ApiError(503, str(err))
    if isinstance(err, Cancelled):
        return ApiError(499, str(err))  # nginx's "client closed request": nobody reads it
    if isinstance(err, ZooError):
        return ApiError(400, str(err))
    return ApiError(500, f"generation failed: {type(err).__name__}: {err}")


def error_body(err: ApiError) -> dict:
    """The error object of an ApiError."""
    kind = "invalid_request_error" if err.status < 500 else "server_error"
    return error(str(err), kind, err.param, err.code)


def validation_error(err: RequestValidationError) -> ApiError:
    """FastAPI's body validation error -> a 400 naming the first bad field (OpenAI: not 422)."""
    first = err.errors()[0]
    loc = [str(x) for x in first.get("loc", ())][1:]  # drop "body"
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg"))
        return ApiError(400, f"malformed JSON body: {detail}")
    if not loc:  # the body itself: not a JSON object, or sent without its content type
        return ApiError(400, "the body must be a JSON object sent as application/json")
    where = ".".join(loc)
    return ApiError(400, f"invalid '{where}': {first.get('msg')}", param=where)


# --- responses -------------------------------------------------------------------------------
def request_id(prefix: str) -> str:
    """A fresh response id, e.g. chatcmpl-<32 hex digits>."""
    return f"{prefix}-{uuid.uuid4().hex}"


def model_list(name: str, max_seq_len: int, created: int) -> dict:
    """The body of GET /v1/models: the one served model (max_model_len as vLLM's)."""
    card = {"id": name, "object": "model", "created": created, "owned_by": "zoo"}
    return {"object": "list", "data": [{**card, "max_model_len": max_seq_len}]}


def _token(tok: Tokenizer | None, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False) if tok else f"<{token_id}>"


def chat_logprobs(tok: Tokenizer | None, lps: list[TokenLogprob]) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}"""

    def entry(token_id: int, logprob: float) -> dict:
        text = _token(tok, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(*t) for t in lp.top.items()]}
            for lp in lps
        ]
    }


def completion_logprobs(tok: Tokenizer | None, lps: list[TokenLogprob], offset: int = 0) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}"""
    tokens = [_token(tok, lp.token_id) for lp in lps]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{_token(tok, t): v for t, v in lp.top.items()} for lp in lps],
        "text_offset": offsets,
    }


class Reply:
    """Builds the response (or the stream's chunks) of one request."""

    def __init__(self, kind: Literal["chat", "completion"], model: str):
        self.kind, self.model = kind, model
        self.id = request_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())
        self.include_usage = False  # streaming: every chunk carries "usage": null but the last

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, logprobs, finish: str | None, delta: bool) -> dict:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "completion":
            choice["text"] = text or ""
        elif delta:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        return {**choice, "logprobs": logprobs, "finish_reason": finish}

    def full(self, result: GenerationResult, logprobs) -> dict:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        choice = self._choice(result.text, logprobs, result.finish_reason, delta=False)
        return {**self._head(obj), "choices": [choice], "usage": result.usage}

    def chunk(
        self, text: str | None, logprobs=None, finish: str | None = None, role: bool = False
    ) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        choice = self._choice(text, logprobs, finish, delta=True)
        if role:
            choice["delta"]["role"] = "assistant"
        out = {**self._head(obj), "choices": [choice]}
        return {**out, "usage": None} if self.include_usage else out

    def usage_chunk(self, result: GenerationResult) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": result.usage}
