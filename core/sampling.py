"""Sampling parameters (validated with pydantic) and the logits -> token step.

Order of operations, as in vLLM: penalties, temperature, top-k, top-p, min-p, then a draw.
All of it runs on the logits' device; nothing here syncs with the host. `next_tokens` applies
them to a batch whose rows may each have their own parameters (grouped by `sampler_groups`).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from core.errors import RequestError


class SamplingParams(BaseModel):
    """What `Model.generate` / `Model.stream` accept besides the prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0)  # 0 = greedy
    top_k: int = Field(0, ge=0)  # 0 = off
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)  # transformers' multiplicative penalty
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)  # OpenAI's additive penalties
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator accepts
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)  # top-n alternatives per generated token
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit
    logit_bias: tuple[tuple[int, float], ...] = ()
    # structured output (core/structured.py): the answer is JSON matching this schema (a dict
    # or its JSON text), or any JSON object
    json_schema: str | None = None
    json_object: bool = False
    # vLLM's: False keeps special tokens in the text (the server reads tool-call markers and
    # gpt-oss's channels from it)
    skip_special_tokens: bool = True

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_pairs(cls, v: Any) -> Any:
        if isinstance(v, dict):  # JSON's keys are strings: {"50256": -100}
            try:
                return tuple(sorted((int(k), b) for k, b in v.items()))
            except (TypeError, ValueError):
                raise ValueError("keys must be token ids") from None
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        bad = [(t, b) for t, b in v if t < 0 or not -100 <= b <= 100]
        if bad:
            raise ValueError(f"token ids must be >= 0 and biases in [-100, 100] (got {bad[:3]})")
        return v

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema(cls, v: Any) -> Any:
        from core.structured import schema_text

        return None if v is None else schema_text(v)

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @classmethod
    def build(cls, defaults: dict[str, Any], **params: Any) -> SamplingParams:
        """Validate `params` over `defaults`; a bad value raises `RequestError` naming it."""
        try:
            return cls(**{**defaults, **params})
        except ValidationError as err:
            parts = []
            for e in err.errors():
                name = ".".join(str(x) for x in e["loc"])
                if e["type"] == "extra_forbidden":
                    parts.append(f"unknown parameter '{name}'")
                else:
                    msg = e["msg"].removeprefix("Value error, ")
                    parts.append(f"'{name}': {msg} (got {e.get('input')!r})")
            raise RequestError("invalid generation parameter " + "; ".join(parts)) from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def defaults_from_generation_config(gen: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json keys -> SamplingParams defaults (only what the file sets)."""
    out: dict[str, Any] = {}
    if gen.get("do_sample"):
        out["temperature"] = gen.get("temperature", 1.0)
        for key in ("top_k", "top_p", "min_p"):
            if gen.get(key) is not None:
                out[key] = gen[key]
    elif "do_sample" in gen:
        out["temperature"] = 0.0
    if gen.get("repetition_penalty") is not None:
        out["repetition_penalty"] = gen["repetition_penalty"]
    if gen.get("max_new_tokens"):
        out["max_new_tokens"] = gen["max_new_tokens"]
    return out


def apply_penalties(
    logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, p: SamplingParams
) -> torch.Tensor:
    """logits (B, V) fp32; counts (B, V): generated-token counts; seen (B, V) bool: prompt or
    generated. Repetition penalty divides positive logits and multiplies negative ones."""
    if p.repetition_penalty != 1.0:
        penalized = torch.where(
            logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty
        )
        logits = torch.where(seen, penalized, logits)
    if p.frequency_penalty:
        logits = logits - p.frequency_penalty * counts
    if p.presence_penalty:
        logits = logits - p.presence_penalty * (counts > 0)
    return logits


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p (smallest set with mass >= p), min-p; masked to -inf."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (probs.cumsum(dim=-1) - probs) >= p.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if p.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(
            probs < p.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf")
        )
    return logits


def draw(logits: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row from softmax(logits), each row with its own generator (B,)."""
    probs = logits.softmax(dim=-1)
    # exponential race: argmax(p / E) with E ~ Exp(1) samples from p, one generator per row
    noise = torch.empty_like(probs)
    for row, g in enumerate(generators):
        noise[row].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def penalizes(p: SamplingParams) -> bool:
    """Whether p asks for any penalty (the loop then keeps per-row token counts)."""
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)


def _sampler_key(p: SamplingParams) -> tuple:
    """Rows whose parameters share this key are sampled together, as one (n, V) block."""
    return (
        p.temperature,
        p.top_k,
        p.top_p,
        p.min_p,
        p.repetition_penalty,
        p.presence_penalty,
        p.frequency_penalty,
    )


Group = tuple[list[int], torch.Tensor | None]  # rows, and their index tensor (None: all rows)


def sampler_groups(ps: list[SamplingParams], device: torch.device) -> list[Group]:
    """The groups of rows sampled alike, made once per loop (an index tensor made per step
    would cost a host-to-device copy: a sync on GPUs). One group needs no indexing."""
    groups: dict[tuple, list[int]] = {}
    for row, p in enumerate(ps):
        groups.setdefault(_sampler_key(p), []).append(row)
    if len(groups) == 1:
        return [(list(range(len(ps))), None)]
    return [(rows, torch.tensor(rows, device=device)) for rows in groups.values()]


def next_tokens(
    logits: torch.Tensor,
    ps: list[SamplingParams],
    groups: list[Group],
    generators: list[torch.Generator | None],
    counts: torch.Tensor | None,
    seen: torch.Tensor | None,
) -> torch.Tensor:
    """One token per row (B,) from logits (B, V), each row by its own parameters; on the
    logits' device, reading nothing back to the host."""
    if len(groups) > 1:
        tokens = torch.empty(len(ps), dtype=torch.long, device=logits.device)
    for rows, idx in groups:
        p = ps[rows[0]]
        x = logits if idx is None else logits[idx]
        if penalizes(p):
            x = apply_penalties(x, *(t if idx is None else t[idx] for t in (counts, seen)), p)
        if p.greedy:
            chosen = x.argmax(dim=-1)
        else:
            chosen = draw(filter_logits(x, p), [generators[r] for r in rows])
        if idx is None:
            return chosen
        tokens[idx] = chosen
    return tokens
