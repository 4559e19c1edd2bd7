"""The checkpoint's tokenizer, over the `tokenizers` library."""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    """encode / decode with the checkpoint's tokenizer.json."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer | None:
        """The folder's tokenizer, or None when it ships no tokenizer.json."""
        f = folder / "tokenizer.json"
        return cls(f) if f.is_file() else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
