"""The speculative-decoding flags of `zoo run`, `chat`, `serve` and `bench` (--spec, --draft,
--spec-k), read into load_model's `speculative=` (core/speculative.py, docs/speculative.md),
and how much of the drafts the model took, for the stats line and `zoo bench`'s report."""

from __future__ import annotations

import argparse
import copy
from typing import TYPE_CHECKING

from core.errors import ConfigError

if TYPE_CHECKING:  # (torch loads on first use: `zoo list` and `zoo --help` stay fast)
    from core.speculative import SpecStats

K_DEFAULT = 7  # SpecConfig's k, said in --help without importing torch (a test compares)


def add_options(p: argparse.ArgumentParser) -> None:
    """--spec, --draft and --spec-k on a subcommand's parser."""
    g = p.add_argument_group("speculative decoding (docs/speculative.md)")
    g.add_argument(
        "--spec",
        choices=("ngram", "mtp"),
        default=None,
        help="draft tokens and verify them in one step, the same tokens as without: ngram "
        "(prompt lookup: what followed the last words where they occurred before), mtp (the "
        "checkpoint's multi-token-prediction layers)",
    )
    g.add_argument(
        "--draft",
        metavar="MODEL",
        default=None,
        help="draft with this smaller model sharing the tokenizer (any name zoo loads)",
    )
    g.add_argument(
        "--spec-k",
        type=int,
        default=None,
        metavar="N",
        help=f"most tokens drafted per step (default {K_DEFAULT}; "
        "each sequence drafts fewer while its drafts are refused)",
    )


def speculative(args: argparse.Namespace) -> dict | None:
    """load_model's `speculative=` from the flags (None: none given); a combination that
    means nothing is one line naming the flags and the fix."""
    spec, draft, k = (getattr(args, a, None) for a in ("spec", "draft", "spec_k"))
    if spec is not None and draft is not None:
        raise ConfigError(
            f"--spec {spec} and --draft {draft}: --draft drafts with a model, --spec {spec} "
            "without one; give one of the two"
        )
    if spec is None and draft is None:
        if k is not None:
            raise ConfigError(
                f"--spec-k {k} sets how many tokens speculative decoding drafts; turn it on "
                "with --spec ngram, --spec mtp or --draft MODEL"
            )
        return None
    if k is not None:
        low, high = _bounds("k")
        if not low <= k <= high:
            raise ConfigError(f"--spec-k {k}: pass a number of tokens from {low} to {high}")
    value: dict = {"method": "draft" if draft is not None else spec}
    if draft is not None:
        value["draft"] = draft
    if k is not None:
        value["k"] = k
    return value


def _bounds(name: str) -> tuple[int, int]:
    """(ge, le) of a SpecConfig field, as it declares them."""
    from core.speculative import SpecConfig

    meta = SpecConfig.model_fields[name].metadata
    low = next(m.ge for m in meta if hasattr(m, "ge"))
    high = next(m.le for m in meta if hasattr(m, "le"))
    return low, high


def describe(stats: SpecStats | None) -> str:
    """'71% accepted, 3.4 tokens/step' ('nothing drafted' when none was): the share of the
    drafted tokens the model took, and the tokens a verifying step took on average (vLLM's
    mean acceptance length: the target's own token included)."""
    if stats is None or not stats.drafts:
        return "nothing drafted"
    return f"{stats.acceptance_rate:.0%} accepted, {stats.mean_accepted_length:.1f} tokens/step"


def stats_note(model, result) -> str:
    """What the stats line of `zoo run` / `chat` adds about a result's speculation: '' when
    the model does not speculate, else '; spec ngram: 71% accepted, 3.4 tokens/step'."""
    spec = getattr(model, "speculator", None)
    if spec is None:
        return ""
    return f"; spec {spec.config.method}: {describe(result.speculation)}"


def snapshot(model) -> SpecStats | None:
    """A copy of the model's counts of drafts so far (None: it does not speculate)."""
    spec = getattr(model, "speculator", None)
    return None if spec is None else copy.deepcopy(spec.stats)


def since(model, before: SpecStats | None) -> dict[str, float]:
    """The acceptance figures of the drafts made since `before` (a `snapshot`), for `zoo
    bench`: {} where the model does not speculate."""
    now = snapshot(model)
    if now is None or before is None:
        return {}
    from core.speculative import SpecStats

    drafts = now.drafts - before.drafts
    stats = SpecStats(drafts, now.draft_tokens - before.draft_tokens,
                      now.accepted_tokens - before.accepted_tokens)  # fmt: skip
    return {
        "drafts": drafts,
        "draft_tokens": stats.draft_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
    }


def method(model) -> str:
    """'ngram (k <= 7, adaptive)': how the model drafts, for `zoo bench`; '' when it does not."""
    spec = getattr(model, "speculator", None)
    if spec is None:
        return ""
    c = spec.config
    return f"{c.method} (k <= {c.k}{', adaptive' if c.adaptive else ''})"


def columns(figures: dict) -> str:
    """`zoo bench`'s decode row's acceptance columns, from `since`'s figures (n/a: no step
    drafted anything)."""
    if not figures.get("drafts"):
        return f" {'n/a':>9} {'n/a':>9}"
    return f" {figures['acceptance_rate']:>9.0%} {figures['mean_accepted_length']:>9.2f}"
