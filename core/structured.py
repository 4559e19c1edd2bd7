"""Structured output: constrained decoding over llguidance.

A grammar (from a JSON schema, or "any JSON object") is checked once, when the sampling
parameters are built; the token loop then gives each constrained row a `Constraint`, which
masks the tokens the grammar cannot take next (`mask`) and follows the ones the row takes
(`accept`). llguidance was chosen by measured per-token cost on CPUs and by upkeep
(benchmarks/structured_overhead.py; docs/benchmarks.md): 0.14 ms a token, 2.6% of SmolLM2's
fused CPU decode step, no dependencies of its own.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import numpy as np
import torch

from core.errors import RequestError
from core.tokenizer import Tokenizer

ANY_OBJECT = {"type": "object"}  # response_format {"type": "json_object"}
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def schema_text(schema: Any) -> str:
    """A JSON schema (dict, or its JSON text) checked and written canonically; a bad one
    raises ValueError naming the part at fault (as a JSON path) and what is wrong there."""
    import llguidance
    from jsonschema import Draft202012Validator, SchemaError

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"not valid JSON ({err})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as err:
        raise ValueError(f"invalid schema at {err.json_path}: {err.message}") from None
    text = json.dumps(schema)  # (key order kept: properties are written in the order given)
    problem = llguidance.LLMatcher.validate_grammar(grammar(text))
    if problem:  # valid JSON Schema that llguidance cannot enforce (an unsupported keyword...)
        raise ValueError(f"schema not supported for constrained decoding: {problem}")
    return text


def grammar(schema: str) -> str:
    """llguidance's grammar for a schema's JSON text (any whitespace-free JSON document)."""
    import llguidance

    options = {"whitespace_flexible": False}  # compact JSON: fewer tokens for small models
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)


def _ll_tokenizer(tok: Tokenizer, vocab_size: int, eos: tuple[int, ...]):
    """llguidance's view of a tokenizer (about 0.2 s to build: kept per tokenizer)."""
    import llguidance

    cache = _tokenizers.setdefault(tok, {})
    key = (vocab_size, eos)
    if key not in cache:
        cache[key] = llguidance.LLTokenizer(
            tok._tok.to_str(), n_vocab=vocab_size, eos_token=list(eos)
        )
    return cache[key]


class Constraint:
    """One row's grammar state: which tokens may come next, and the tokens taken so far."""

    def __init__(self, schema: str, tok: Tokenizer, vocab_size: int, eos: set[int]):
        import llguidance

        lltok = _ll_tokenizer(tok, vocab_size, tuple(sorted(eos)))
        self.matcher = llguidance.LLMatcher(lltok, grammar(schema), log_level=0)
        if self.matcher.is_error():  # checked in SamplingParams already: not the user's fault
            raise RuntimeError(f"llguidance refused a checked grammar: {self.matcher.get_error()}")

    def fill(self, bits: torch.Tensor) -> None:
        """Write the allowed-token bitmask into `bits` (V/32,) int32, contiguous on the CPU."""
        self.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)

    def accept(self, token: int) -> bool:
        """Take the row's token; True when the grammar is complete (only EOS may follow)."""
        if not self.matcher.consume_token(token):  # only a limit of llguidance's: the schema's
            raise RequestError(
                f"the JSON schema's grammar gave out while the answer was written (token "
                f"{token}): {self.matcher.get_error().partition(chr(10))[0]}; simplify the "
                "schema (a recursion "
                "with no way out, say)"
            )
        return self.matcher.is_stopped()


def make_constraint(p: Any, tok: Tokenizer | None, vocab_size: int, eos: set[int]):
    """The row's Constraint for SamplingParams `p`, or None when it asks for none."""
    schema = p.json_schema or (json.dumps(ANY_OBJECT) if p.json_object else None)
    if schema is None:
        return None
    if tok is None:
        raise RuntimeError("structured output needs the model's tokenizer")
    if not eos:  # (llguidance ends a grammar on one; it would raise a bare ValueError)
        raise RequestError(
            "json_schema / json_object need a token that ends the answer, and ignore_eos=True "
            "leaves none: drop ignore_eos, or name one in stop_token_ids"
        )
    return Constraint(schema, tok, vocab_size, eos)


class Masks:
    """The allowed-token masks of a batch's constrained rows, applied to its logits each step."""

    def __init__(self, constraints: list[Constraint | None], vocab_size: int):
        self.rows = [(i, c) for i, c in enumerate(constraints) if c is not None]
        self.vocab = vocab_size
        self.bits = torch.full((len(constraints), (vocab_size + 31) // 32), -1, dtype=torch.int32)

    def apply(self, logits: torch.Tensor, ended: list[bool]) -> torch.Tensor:
        """logits (B, V) with the tokens each running constrained row may not take at -inf."""
        for row, c in self.rows:
            if not ended[row]:
                c.fill(self.bits[row])
        # (B, V/32) words -> (B, V) bits, least significant first (llguidance's layout)
        words = self.bits.numpy().view(np.uint8)
        banned = np.unpackbits(words, axis=1, bitorder="little")[:, : self.vocab] == 0
        if logits.device.type == "cpu":  # numpy: one thread (torch's would sync its pool)
            out = logits.numpy().copy()
            np.putmask(out, banned, -np.inf)
            return torch.from_numpy(out)
        return logits.masked_fill(torch.from_numpy(banned).to(logits.device), float("-inf"))
