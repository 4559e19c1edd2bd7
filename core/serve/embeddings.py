"""`POST /v1/embeddings`: OpenAI's embeddings endpoint over the served decoder.

A request is checked here (its model, inputs, token ids, lengths, `dimensions`: 400s naming the
field), then queued as one `EmbedJob`: the scheduler thread runs it whole in a free cache row
between two steps (core/serve/scheduler.py), pooled as `Model.pooling` says. Served when the
server's task is "embed" (`zoo serve --task embed`, or a checkpoint with sentence-transformers
files). See docs/serve.md.
"""

from __future__ import annotations

import asyncio
import base64

import torch
from fastapi import APIRouter, Request

from core.embedding import has_sentence_transformers
from core.errors import RequestError
from core.serve.requests import Served, check_name, encoded, submit
from core.serve.schemas import ApiError, EmbeddingRequest
from core.serve.seq import EmbedJob
from core.serve.stream import results

TASKS = ("generate", "embed")
MAX_INPUTS = 2048  # inputs a request (OpenAI's bound)
router = APIRouter()


def resolve_task(task: str | None, model) -> str:
    """The server's task: the one given, else "embed" for a checkpoint that ships
    sentence-transformers files (`modules.json`), else "generate". An embedding task reads the
    model's pooling now, so a bad pooling config stops the server before it listens."""
    if task is None:
        task = "embed" if has_sentence_transformers(model.path) else "generate"
    if task not in TASKS:
        raise RequestError(f"unknown task '{task}'; use one of {', '.join(TASKS)}")
    if task == "embed":
        if getattr(model.net, "lead", None) is not None:  # CausalLM.hidden runs on one rank
            raise RequestError(
                "embeddings are not available with tensor parallelism (--tp); serve "
                "with --task generate, or without --tp"
            )
        model.pooling  # noqa: B018  (read and checked now)
    return task


def _inputs(req: EmbeddingRequest) -> list:
    """The request's inputs as a list (one text or one id list is a list of one)."""
    given = req.input
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        return [given]
    if not given:
        raise ApiError(400, "input is an empty list; pass a text or a list of them", param="input")
    if len(given) > MAX_INPUTS:
        message = f"input holds {len(given)} items; at most {MAX_INPUTS} a request"
        raise ApiError(400, message, param="input")
    return list(given)


def _encoded(s: Served, req: EmbeddingRequest) -> list[list[int]]:
    """Each input's ids (texts encoded as prompts, with BOS), checked against the vocabulary
    and the context length."""
    items = _inputs(req)
    out = []
    for i, item in enumerate(items):
        where = "input" if len(items) == 1 else f"input.{i}"
        if isinstance(item, str) and not item:
            raise ApiError(400, f"{where} is an empty string; pass some text", param=where)
        ids = encoded(lambda item=item: s.model.encode_prompt(item), where)
        if len(ids) > s.model.max_seq_len:
            raise ApiError(
                400,
                f"{where} ({len(ids)} tokens) exceeds the context length "
                f"({s.model.max_seq_len} tokens); shorten it or restart zoo serve with a "
                "larger --max-seq-len",
                param=where,
                code="context_length_exceeded",
            )
        out.append(ids)
    return out


def _item(i: int, vector: torch.Tensor, fmt: str) -> dict:
    """One embedding object: floats, or base64 of little-endian float32 bytes (OpenAI's)."""
    if fmt == "base64":
        raw = vector.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        value = base64.b64encode(raw).decode("ascii")
    else:
        value = vector.tolist()
    return {"object": "embedding", "index": i, "embedding": value}


@router.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, request: Request):
    s: Served = request.app.state.zoo
    check_name(s, req.model)
    if s.task != "embed":
        message = (
            f"this server runs '{s.name}' for text generation; restart it with "
            "`zoo serve --task embed` to serve embeddings"
        )
        raise ApiError(400, message, param="model")
    ids = _encoded(s, req)
    pooling = s.model.pooling
    size = s.model.config.hidden_size * len(pooling.modes)
    if req.dimensions is not None and req.dimensions != size:
        message = f"dimensions={req.dimensions}: this model's embeddings have {size} (no other)"
        raise ApiError(400, message, param="dimensions")
    job = EmbedJob(ids, pooling, asyncio.get_running_loop())
    busy = submit(s, [job])
    if busy is not None:
        return busy
    (vectors,) = await results([job], request)
    tokens = sum(len(x) for x in ids)
    return {
        "object": "list",
        "data": [_item(i, v, req.encoding_format) for i, v in enumerate(vectors)],
        "model": s.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
