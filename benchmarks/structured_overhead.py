"""What constrained decoding costs per token, against one decode step of the model: each
grammar library (llguidance, xgrammar, outlines-core: whichever is installed) walks the tokens
of a JSON document that matches a schema, computing the allowed-token mask, applying it to a
(1, vocab) row of logits and taking the token, as the token loop does.

    python benchmarks/structured_overhead.py [MODEL] [--tokens 64] [--repeat 3]

Prints the model's decode step (ms), each library's grammar compile time (ms, once per schema)
and its per-token cost (ms and % of a decode step). The issue's target: at most 10%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from core import load_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "tags", "member"],
    "additionalProperties": False,
}
DOC = {
    "name": "Ada Lovelace",
    "age": 36,
    "city": "London",
    "tags": ["mathematics", "poetry", "engines", "notes", "Bernoulli numbers"],
    "member": True,
}


def _llguidance(tok, vocab: int, eos: list[int]):
    """What Zoo runs: core.structured's Constraint and Masks."""
    from core.structured import Constraint, Masks

    t = time.perf_counter()
    Constraint(json.dumps(SCHEMA), tok, vocab, set(eos))  # builds llguidance's tokenizer once
    tok_s = time.perf_counter() - t

    def start():
        c = Constraint(json.dumps(SCHEMA), tok, vocab, set(eos))
        masks = Masks([c], vocab)

        def step(logits: torch.Tensor, token: int) -> None:
            masks.apply(logits, [False])
            c.accept(token)

        return step

    return tok_s, start


def _xgrammar(tok, vocab: int, eos: list[int]):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok._tok)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info)
    tok_s = time.perf_counter() - t
    bits = xgr.allocate_token_bitmask(1, vocab)

    def start():
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))

        def step(logits: torch.Tensor, token: int) -> None:
            matcher.fill_next_token_bitmask(bits)
            xgr.apply_token_bitmask_inplace(logits, bits)
            assert matcher.accept_token(token)

        return step

    return tok_s, start


def _outlines_core(tok, vocab: int, eos: list[int]):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t = time.perf_counter()
    # byte-level BPE (GPT-2's alphabet: one printable character per byte) -> the token's bytes
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = printable + [256 + k for k in range(256 - len(printable))]
    to_byte = {
        chr(c): b
        for c, b in zip(chars, printable + sorted(set(range(256)) - set(printable)), strict=True)
    }
    tokens: dict[bytes, list[int]] = {}
    for text, i in tok._tok.get_vocab(with_added_tokens=False).items():
        if i not in eos and all(c in to_byte for c in text):
            tokens.setdefault(bytes(to_byte[c] for c in text), []).append(i)
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(eos[0], tokens))
    tok_s = time.perf_counter() - t  # (outlines-core builds the index per schema)
    from core.structured import Masks

    class Filled:  # the guide's mask through Zoo's own Masks (as llguidance's is)
        def __init__(self, guide):
            self.guide = guide

        def fill(self, bits: torch.Tensor) -> None:
            self.guide.write_mask_into(bits.data_ptr(), bits.numel(), bits.element_size())

    def start():
        guide = Guide(index)
        masks = Masks([Filled(guide)], vocab)

        def step(logits: torch.Tensor, token: int) -> None:
            masks.apply(logits, [False])
            if token not in eos:  # (its guide refuses EOS where the others take it)
                guide.advance(token, return_tokens=False)

        return step

    return tok_s, start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens timed")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each measurement (median)")
    args = ap.parse_args()

    m = load_model(args.model)
    vocab, tok = m.config.vocab_size, m.tokenizer
    eos = sorted(m.eos_token_ids)
    prompt = "Describe a person as JSON."
    m.generate(prompt, max_new_tokens=8)  # warm-up
    rates = [
        m.generate(prompt, max_new_tokens=args.tokens, ignore_eos=True).timings[
            "decode_tokens_per_s"
        ]
        for _ in range(args.repeat)
    ]
    step_ms = 1000 / statistics.median(rates)
    threads = torch.get_num_threads()
    print(f"{args.model}: decode step {step_ms:.2f} ms (batch 1, {threads} threads)")

    compact = json.dumps(DOC, separators=(",", ":"))  # as Zoo writes JSON
    doc = [*tok.encode(compact, add_special_tokens=False), eos[0]]
    libs = {
        "llguidance": lambda: _llguidance(tok, vocab, eos),
        "xgrammar": lambda: _xgrammar(tok, vocab, eos),
        "outlines-core": lambda: _outlines_core(tok, vocab, eos),
    }
    for name, make in libs.items():
        try:
            setup_s, start = make()
        except ImportError as err:
            print(f"{name}: not installed ({err})")
            continue
        times, compiles = [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            step = start()
            compiles.append(time.perf_counter() - t)
            logits = torch.randn(len(doc), vocab)
            t = time.perf_counter()
            for i, token in enumerate(doc):
                step(logits[i : i + 1], token)
            times.append((time.perf_counter() - t) / len(doc))
        per_token = 1000 * statistics.median(times)
        print(
            f"{name}: tokenizer setup {1000 * setup_s:.0f} ms,"
            f" grammar {1000 * compiles[0]:.1f} ms (first),"
            f" {per_token:.3f} ms/token over {len(doc)} tokens"
            f" = {100 * per_token / step_ms:.1f}% of a decode step"
        )


if __name__ == "__main__":
    main()
