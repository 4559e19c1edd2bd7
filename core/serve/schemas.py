"""The OpenAI API's request bodies (pydantic), its error object, and the JSON objects
`core.serve.app` answers with.

A field Zoo does not implement is refused with a 400 naming it, rather than silently ignored
(the clients' harmless extras, HARMLESS, are accepted and unused); sampling values are
range-checked once, by `SamplingParams` (core/serve/app.py names the request's field).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from core.errors import ZooError
from core.generation import GenerationResult, TokenLogprob
from core.serve.scheduler import Cancelled, ShuttingDown
from core.tokenizer import Tokenizer

# fields clients send that change nothing in an answer: accepted, unused (docs/serve.md)
HARMLESS = ("user", "store", "metadata", "service_tier")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # validation_error names the unknown field


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # always enforced


class ResponseFormat(_Strict):
    """OpenAI's response_format: text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object with a 'schema'")
        return self


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # forced calls always match; "auto" ones are parsed as written


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class _Request(_Strict):
    model: str
    # harmless extras (HARMLESS)
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

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
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]

    def sampling(self) -> dict[str, Any]:
        """SamplingParams fields this request sets (max_new_tokens and logprobs aside)."""
        keys = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty")
        keys += ("top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids")
        keys += ("logit_bias",)
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
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: "required" writes exactly one call
    # vLLM's: more variables for the chat template (Qwen3's enable_thinking, a date_string...)
    chat_template_kwargs: dict[str, Any] | None = None

    def structure(self) -> dict[str, Any]:
        """The SamplingParams fields of response_format (none for text)."""
        f = self.response_format
        if f is None or f.type == "text":
            return {}
        if f.type == "json_object":
            return {"json_object": True}
        return {"json_schema": f.json_schema.schema_}


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


class EmbeddingRequest(_Strict):
    """OpenAI's /v1/embeddings body: a text, token ids, or a list of either."""

    model: str
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # true is no token id
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only the model's own (no truncation: a 400 otherwise)
    user: str | None = None  # harmless (HARMLESS)


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
    # drop "body", and the members of a union pydantic names ("literal[...]", "NamedToolChoice")
    loc = [str(x) for x in first.get("loc", ())][1:]
    loc = [x for x in loc if "[" not in x and not x[:1].isupper()]
    if first.get("type") == "extra_forbidden":
        where = ".".join(loc)
        return ApiError(
            400,
            f"unknown field '{where}': Zoo does not implement it; remove it (accepted and unused: "
            f"{', '.join(HARMLESS)}; see docs/serve.md)",
            param=where,
        )
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


def model_card(name: str, max_seq_len: int, created: int) -> dict:
    """The served model's object, as GET /v1/models/{id} answers (max_model_len as vLLM's)."""
    card = {"id": name, "object": "model", "created": created, "owned_by": "zoo"}
    return {**card, "max_model_len": max_seq_len}


def model_list(name: str, max_seq_len: int, created: int) -> dict:
    """The body of GET /v1/models: the one served model."""
    return {"object": "list", "data": [model_card(name, max_seq_len, created)]}


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

    def _choice(
        self,
        text: str | None,
        logprobs,
        finish: str | None,
        delta: bool,
        index: int = 0,
        calls: list[dict] | None = None,
        reasoning: str | None = None,
    ) -> dict:
        choice: dict[str, Any] = {"index": index}
        if self.kind == "completion":
            choice["text"] = text or ""
        elif delta:
            choice["delta"] = {} if text is None else {"content": text}
            if reasoning:  # vLLM's field for a reasoning model's thinking
                choice["delta"] = {"reasoning_content": reasoning}
            if calls:  # already deltas: each with its call's index (see server_stream)
                choice["delta"]["tool_calls"] = calls
        else:
            choice["message"] = {"role": "assistant", "content": text}
            if reasoning is not None:
                choice["message"]["reasoning_content"] = reasoning or None
            if calls:
                choice["message"]["tool_calls"] = calls
        return {**choice, "logprobs": logprobs, "finish_reason": finish}

    def full(
        self,
        results: list[GenerationResult],
        logprobs: list,
        echo: str = "",
        answers: list[tuple[str | None, list[dict] | None, str | None]] | None = None,
    ) -> dict:
        """The whole answer: a choice per result (n of them), `echo` before each text;
        `answers`: each choice's (content, tool_calls, reasoning) when tools were offered or
        the model reasons."""
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        choices = []
        for i, (r, lp) in enumerate(zip(results, logprobs, strict=True)):
            text, calls, reasoning = answers[i] if answers else (echo + r.text, None, None)
            cut = r.finish_reason == "length"  # (then the calls are those written whole)
            finish = "tool_calls" if calls and not cut else r.finish_reason
            choice = self._choice(text, lp, finish, False, i, calls, reasoning)
            choices.append(choice)
        return {**self._head(obj), "choices": choices, "usage": usage(results)}

    def chunk(
        self,
        text: str | None,
        logprobs=None,
        finish: str | None = None,
        role: bool = False,
        index: int = 0,
        calls: list[dict] | None = None,
        reasoning: str | None = None,
    ) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        choice = self._choice(text, logprobs, finish, True, index, calls, reasoning)
        if role:
            choice["delta"]["role"] = "assistant"
        out = {**self._head(obj), "choices": [choice]}
        return {**out, "usage": None} if self.include_usage else out

    def usage_chunk(self, results: list[GenerationResult]) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(results)}


def usage(results: list[GenerationResult]) -> dict[str, int]:
    """One prompt's tokens (counted once, as OpenAI does for n > 1; its cached tokens those
    of the first choice) and every choice's."""
    out, done = dict(results[0].usage), sum(len(r.token_ids) for r in results)
    out.update(completion_tokens=done, total_tokens=out["prompt_tokens"] + done)
    return out
