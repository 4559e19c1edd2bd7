"""Hub rope blocks (`rope_scaling` / `rope_parameters`, any key style) -> `RopeSpec`.

`ROPE_KINDS` maps each `rope_type` to a builder(params, theta, rotary dims, dto: the
`core.hfconfig.DecoderConfig`, read for max_position_embeddings and the like); its parameter
block is validated by pydantic (unknown keys ignored), the derived factors computed as
transformers computes them. `core.hfconfig.DecoderConfig.rope_spec` looks kinds up here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt

from core.config import (
    DefaultRope,
    DynamicRope,
    LinearRope,
    Llama3Rope,
    LongRope,
    RopeSpec,
    YarnRope,
)
from core.errors import ConfigError


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `scale` times (DeepSeek's form)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


class _Params(BaseModel):
    """Base of the per-kind rope parameter blocks: unknown keys are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class _Factor(_Params):
    factor: PositiveFloat


class _Llama3(_Params):
    factor: PositiveFloat
    low_freq_factor: PositiveFloat
    high_freq_factor: PositiveFloat
    original_max_position_embeddings: PositiveInt


class _Yarn(_Params):
    factor: PositiveFloat
    original_max_position_embeddings: PositiveInt
    beta_fast: float | None = None  # None (or 0): 32, as in transformers
    beta_slow: float | None = None  # None (or 0): 1
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: PositiveFloat | None = None  # None: derived from factor and the mscales
    truncate: bool = True


class _LongRope(_Params):
    short_factor: list[PositiveFloat]
    long_factor: list[PositiveFloat]
    original_max_position_embeddings: PositiveInt
    factor: PositiveFloat | None = None  # None: max_position_embeddings / original
    attention_factor: PositiveFloat | None = None  # None: derived from factor


def _default(p: dict, theta: float, dim: int, cfg: Any) -> RopeSpec:
    return DefaultRope(theta=theta, dim=dim)


def _linear(p: dict, theta: float, dim: int, cfg: Any) -> RopeSpec:
    return LinearRope(theta=theta, dim=dim, factor=_Factor(**p).factor)


def _dynamic(p: dict, theta: float, dim: int, cfg: Any) -> RopeSpec:
    factor = _Factor(**p).factor
    return DynamicRope(
        theta=theta, dim=dim, factor=factor, max_position_embeddings=cfg.max_position_embeddings
    )


def _llama3(p: dict, theta: float, dim: int, cfg: Any) -> RopeSpec:
    p = {"original_max_position_embeddings": cfg.max_position_embeddings, **p}
    q = _Llama3(**p)
    # equal factors (Llama 4 Scout: 1.0 and 1.0) leave no band between them: every wave longer
    # than original / low_freq_factor is divided by factor, the others kept (transformers)
    if q.high_freq_factor < q.low_freq_factor:
        raise ConfigError(
            f"rope_scaling: high_freq_factor ({q.high_freq_factor}) must be at least "
            f"low_freq_factor ({q.low_freq_factor})"
        )
    return Llama3Rope(theta=theta, dim=dim, **q.model_dump())


def _yarn(p: dict, theta: float, dim: int, cfg: Any) -> RopeSpec:
    p = {"original_max_position_embeddings": cfg.max_position_embeddings, **p}
    q = _Yarn(**p)
    beta_fast, beta_slow = q.beta_fast or 32.0, q.beta_slow or 1.0
    if beta_fast < beta_slow:
        raise ConfigError(
            f"rope_scaling: beta_fast ({beta_fast}) must not be below beta_slow ({beta_slow})"
        )
    mscale, mscale_all_dim = q.mscale or 0.0, q.mscale_all_dim or 0.0
    attention_factor = q.attention_factor
    if attention_factor is None:  # the same expressions as transformers' _compute_yarn_parameters
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(q.factor, mscale) / yarn_mscale(q.factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(q.factor)
    return YarnRope(
        theta=theta,
        dim=dim,
        factor=q.factor,
        original_max_position_embeddings=q.original_max_position_embeddings,
        beta_fast=float(beta_fast),
        beta_slow=float(beta_slow),
        mscale=float(mscale),
        mscale_all_dim=float(mscale_all_dim),
        attention_factor=float(attention_factor),
        truncate=q.truncate,
    )


def _longrope(p: dict, theta: float, dim: int, cfg: Any) -> RopeSpec:
    # transformers: a top-level original_max_position_embeddings (Phi-3 keeps it there) wins
    # over the one in the rope parameters; absent both, max_position_embeddings
    top = getattr(cfg, "original_max_position_embeddings", None)
    p = {"original_max_position_embeddings": cfg.max_position_embeddings, **p}
    if top is not None:
        p["original_max_position_embeddings"] = top
    q = _LongRope(**p)
    for name in ("short_factor", "long_factor"):
        if len(getattr(q, name)) != dim // 2:
            raise ConfigError(
                f"rope_scaling: field '{name}' has {len(getattr(q, name))} values; the rope "
                f"turns {dim} dims per head, so it needs {dim // 2} (one per frequency)"
            )
    old = q.original_max_position_embeddings
    factor = q.factor if q.factor is not None else cfg.max_position_embeddings / old
    attention_factor = q.attention_factor  # the same expressions as transformers
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
    return LongRope(
        theta=theta,
        dim=dim,
        short_factor=tuple(q.short_factor),
        long_factor=tuple(q.long_factor),
        original_max_position_embeddings=old,
        attention_factor=float(attention_factor),
    )


# rope kind -> builder(params, theta, rotary_dim, dto). Plugins extend this table for new kinds.
ROPE_KINDS: dict[str, Callable[[dict, float, int, Any], RopeSpec]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
}
