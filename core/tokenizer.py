"""The checkpoint's tokenizer over the `tokenizers` library, its chat template, and incremental
detokenization for streaming."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from core.errors import ChatTemplateError, ConfigError, RequestError

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _content(tok: Any) -> str | None:
    """special_tokens_map entries are a string or {"content": ...}."""
    return tok.get("content") if isinstance(tok, dict) else tok


class Tokenizer:
    """encode / decode / apply_chat_template with the checkpoint's own files.

    `tok` is a `tokenizers.Tokenizer`; `special` maps bos_token/eos_token/... to their strings;
    `add_bos` says whether encode() must start with BOS (exactly one).
    """

    def __init__(
        self,
        tok: Any,
        *,
        special: dict[str, str] | None = None,
        chat_template: str | None = None,
        add_bos: bool = False,
    ):
        self._tok = tok
        self.special = {k: v for k, v in (special or {}).items() if v}
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.bos_token_id = self.token_to_id(self.special.get("bos_token"))
        self.eos_token_id = self.token_to_id(self.special.get("eos_token"))

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer | None:
        """tokenizer.json + tokenizer_config.json + special_tokens_map.json; None if absent."""
        from tokenizers import Tokenizer as _Tokenizer

        path = folder / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            tok = _Tokenizer.from_file(str(path))
        except Exception as err:  # the tokenizers library raises a bare Exception
            raise ConfigError(
                f"{path}: not a valid tokenizer.json ({err}); re-download it"
            ) from None
        cfg = _read_optional(folder / "tokenizer_config.json")
        special = {
            k: _content(v) for k, v in _read_optional(folder / "special_tokens_map.json").items()
        }
        special.update({k: _content(cfg[k]) for k in SPECIAL_KEYS if cfg.get(k)})
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja = folder / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        return cls(
            tok, special=special, chat_template=template, add_bos=bool(cfg.get("add_bos_token"))
        )

    # --- text <-> ids -------------------------------------------------------------------------
    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab(self) -> dict[str, int]:
        """Every token (added ones included) -> its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with special tokens, it starts with exactly one BOS if the model
        uses one (the tokenizer's post-processor may add it, the text may already hold it)."""
        try:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # the tokenizers library takes no lone surrogate ("\ud800" in JSON)
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise RequestError(
                    f"the text holds {text[err.start : err.end]!r} at character {err.start}, "
                    "half of a UTF-16 surrogate pair, which is no character; send valid Unicode"
                ) from None
            raise
        bos = self.bos_token_id
        if add_special_tokens and bos is not None:
            if self.add_bos and ids[:1] != [bos]:
                ids = [bos, *ids]
            while ids[:2] == [bos, bos]:
                ids = ids[1:]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # --- chat ---------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kw) -> str:
        """The chat template rendered to text, in jinja2's sandbox, as transformers renders it.

        A message whose content is null (an assistant turn that only calls tools, as the openai
        SDK and LangChain send it) goes in as None, which templates such as DeepSeek's test
        (`content is none`); a template that fails on it, or on an absent content (SmolLM2's
        joins it to strings), gets "" instead. Any other failure, of whatever type, is a
        ChatTemplateError naming the message at fault where a shorter conversation tells it."""
        if not self.chat_template:
            raise RequestError("this model has no chat template; send raw text instead")
        from jinja2.exceptions import SecurityError, TemplateError

        try:
            template = _environment().from_string(self.chat_template)
        except TemplateError as err:
            raise ConfigError(f"the model's chat template does not compile: {err}") from None
        # request variables override the special tokens, as in transformers
        variables = {**self.special, **kw}

        def render(msgs: list[dict], prompt: bool) -> str:
            return template.render({**variables, "messages": msgs, "add_generation_prompt": prompt})

        tries = [messages]
        if any(isinstance(m, dict) and m.get("content") is None for m in messages):
            tries.append([_empty_content(m) for m in messages])
        for msgs in tries:
            try:
                return render(msgs, add_generation_prompt)
            except SecurityError as err:
                raise ConfigError(
                    f"chat template refused: it tried an unsafe operation ({err})"
                ) from None
            except Exception as err:  # a template can fail in any way
                failure = err
        raise _failure(failure, tries[-1], render) from None

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kw
    ) -> list[int]:
        """Token ids of the rendered chat (the template writes the special tokens itself)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kw)
        return self.encode(text, add_special_tokens=False)


def _empty_content(message: Any) -> Any:
    """A message whose null or absent content is "" (others as they are)."""
    if isinstance(message, dict) and message.get("content") is None:
        return {**message, "content": ""}
    return message


def _complaint(err: Exception) -> str:
    """What a template's failure says: raise_exception's own words; the type otherwise."""
    from jinja2.exceptions import TemplateError

    if isinstance(err, TemplateError):
        return str(err)
    return f"{type(err).__name__}: {err}"


def _failure(err: Exception, messages: list, render) -> ChatTemplateError:
    """The error of a conversation that failed to render with `err`, naming the first message
    at fault: the shortest leading part of the conversation that fails the same way (found by
    bisection); none when no messages fail the same way too (a variable's fault, say)."""
    said = _complaint(err)

    def fails(k: int) -> bool:  # the first k messages fail as the whole did
        try:
            render(messages[:k], False)
        except Exception as e:  # any failure, compared by what it says
            return _complaint(e) == said
        return False

    lo, hi = 1, len(messages)  # the smallest k in [1, n] such that fails(k), if any
    index = None
    # (failing with no message at all, or not with these: the fault lies elsewhere)
    if messages and fails(hi) and not fails(0):
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fails(mid) else (mid + 1, hi)
        index = lo - 1
    if index is None:
        return ChatTemplateError(f"the chat template failed to render the messages: {said}")
    role = messages[index].get("role") if isinstance(messages[index], dict) else None
    return ChatTemplateError(
        f"messages.{index} (role {role!r}): the chat template failed to render it: {said}",
        index,
    )


def _read_optional(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err}); re-download it") from None
    return data if isinstance(data, dict) else {}


def _environment():
    """jinja2's immutable sandbox with the helpers hub templates expect (as transformers has)."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class StreamDecoder:
    """Turns token ids into text pieces without ever emitting half a UTF-8 character.

    Decodes a short window of recent tokens and emits only what it adds, holding back while the
    tail is an incomplete byte sequence (decoded as U+FFFD), as vLLM and TGI do.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # window start: text before it is final
        self.read = 0  # tokens up to here have been emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it completes (possibly "")."""
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        after = self.tok.decode(self.ids[self.prefix :], self.skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        before = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        after = self.tok.decode(self.ids[self.prefix :], self.skip)
        self.prefix = self.read = len(self.ids)
        return after[len(before) :] if len(after) > len(before) else ""
