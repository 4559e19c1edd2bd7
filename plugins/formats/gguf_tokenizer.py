"""The tokenizer a GGUF file describes, rebuilt with the `tokenizers` library.

A GGUF has no tokenizer.json: it stores the vocabulary, merges, token types and special ids as
`tokenizer.ggml.*` metadata, in llama.cpp's terms. Two vocabularies are rebuilt, as transformers'
GGUF loader builds them: `gpt2` (byte-level BPE) and `llama` (sentencepiece BPE with byte
fallback). Control tokens become special tokens, user-defined ones plain added tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.errors import ConfigError
from core.tokenizer import Tokenizer

CONTROL, USER_DEFINED, UNUSED = 3, 4, 5  # llama.cpp's token types
SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (  # Qwen3.5's: Qwen2's with combining marks (\p{M}) kept in words
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_O200K = (  # o200k's (gpt-oss, GPT-4o): words also split where lower case turns upper
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regexes llama.cpp splits text with before BPE (llama-vocab.cpp);
# unlisted: GPT-2's. SmolLM's splits digits apart first, as its tokenizer.json does. gpt-oss's
# files say `gpt-4o` (its tokenizer's regex is tiktoken's o200k one, as GPT-4o's), Qwen3.5's
# `qwen35`.
PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), (_QWEN2,)),
    "smollm": (r"\p{N}", _GPT2),
    "gpt-4o": (_O200K,),
    "qwen35": (_QWEN35,),
}


def build_tokenizer(meta: dict[str, Any], path: Path) -> Tokenizer | None:
    """The file's tokenizer with its chat template and special tokens; None if it has none."""
    from tokenizers import AddedToken

    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        return None
    kind = meta.get("tokenizer.ggml.model")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok, spelled = _byte_level(meta, tokens)
    elif kind in ("llama", "gemma4"):  # gemma4: the same BPE with byte fallback
        tok, spelled = _sentencepiece(meta, tokens, path), None
    else:
        raise ConfigError(
            f"{path}: tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, llama); "
            "use a checkpoint folder with a tokenizer.json instead"
        )
    special = {k: _token(tokens, meta.get(f"tokenizer.ggml.{v}")) for k, v in SPECIAL_IDS.items()}
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel: adding it would
    # grow the vocabulary past the embedding (transformers skips those too).
    control = [t for t, k in zip(tokens, types, strict=False) if k == CONTROL]
    control += [t for t in special.values() if t and t not in control]
    # padding rows the converter names "[PAD{id}]" (UNUSED): text llama.cpp never prints, so
    # special here (skipped in answers) rather than read as the letters of their name
    control += [t for t, k in zip(tokens, types, strict=False) if k == UNUSED]
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in control if _fits(t, spelled)]
    )
    vocab = tok.get_vocab()
    user = [t for t, k in zip(tokens, types, strict=False) if k == USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return Tokenizer(
        tok,
        special=special,
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
    )


def _token(tokens: list[str], index: Any) -> str | None:
    return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None


def _fits(token: str, alphabet: set[str] | None) -> bool:
    return alphabet is None or set(token) <= alphabet


def _merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]


def _byte_level(meta: dict[str, Any], tokens: list[str]):
    """GPT-2 style byte-level BPE; returns the tokenizer and its byte alphabet."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _Tokenizer

    spell = _bytes_to_unicode()
    alphabet = set(spell.values())
    # a token stored as raw text (outside the byte alphabet) is respelled byte by byte
    vocab = {
        t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    tok = _Tokenizer(models.BPE(vocab, _merges(meta), fuse_unk=False))
    splits = PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if splits is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def _sentencepiece(meta: dict[str, Any], tokens: list[str], path: Path):
    """Llama / Mistral style sentencepiece BPE with byte fallback (`<0x0A>` tokens)."""
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges(meta)
    if not merges:
        scores = meta.get("tokenizer.ggml.scores")
        if not scores:
            raise ConfigError(f"{path}: a llama tokenizer needs tokenizer.ggml.merges or .scores")
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=False)))
    unk = _token(tokens, meta.get("tokenizer.ggml.unknown_token_id"))
    tok = _Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a sentencepiece vocabulary implies: every split of a token into two tokens,
    best-scored merged token first (transformers' `generate_merges`)."""
    found = []
    for token, score in scores.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))]
        pairs = [p for p in pairs if p[0] in vocab and p[1] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found += [(left, right, score) for left, right in pairs]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return table
