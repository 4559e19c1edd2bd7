"""`Model`: a loaded network with its static KV cache, tokenizer and generation defaults."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from core.config import RuntimeConfig
from core.decode_step import DecodeStep
from core.embedding import Pooling, read_pooling
from core.engine import Engine, right_padded
from core.errors import RequestError
from core.generation import GenerationResult, Seq, TokenLogprob, batch_timings
from core.modeling import CausalLM, kernel_errors
from core.sampling import SamplingParams, defaults_from_generation_config
from core.slots import Slots
from core.speculative import Speculator
from core.tokenizer import Tokenizer

Prompt = str | Sequence[int]


def _ids(value: Any) -> list[int] | None:
    """A token-id list, or None if `value` is not one."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    is_seq = isinstance(value, Sequence) and not isinstance(value, str)
    if is_seq and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return [int(i) for i in value]
    return None


class Model:
    """A loaded model. Not thread-safe: one caller at a time (the server queues requests).

    Its cache rows keep what they hold between calls (`slots`): with `prefix_cache` (on by
    default) `generate` / `stream` start each prompt from the longest prefix a row holds, so
    a chat's next turn prefills only its new tokens. Whatever writes the cache outside the
    engine (`forward`, `reset`, `embed`) forgets them; so must a caller of `net` itself
    (`forget`)."""

    def __init__(
        self,
        net: CausalLM,
        tokenizer: Tokenizer | None,
        path: Path,
        generation_config: dict[str, Any] | None = None,
        compile: bool = False,
        prefix_cache: bool = True,
    ):
        self.net = net
        # speculative decoding (core/speculative.py), set by load_model(speculative=...)
        self.speculator: Speculator | None = None
        self.prefix_cache = prefix_cache
        self._slots: tuple[Any, Any, Slots] | None = None  # (cache, lead, its rows' contents)
        self.step = DecodeStep(net, compile)
        # launch each decode step before reading the last one's tokens: GPUs run async
        self.ahead = self.device.type == "cuda"
        self.config: RuntimeConfig = net.config
        self.tokenizer = tokenizer
        self.path = path
        gen = generation_config or {}
        # generation stops on every eos id of config.json and generation_config.json
        extra = gen.get("eos_token_id")
        extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
        self.eos_token_ids: set[int] = set(self.config.eos_token_ids) | set(extra)
        self.defaults: dict[str, Any] = defaults_from_generation_config(gen)
        self._pooling: Pooling | None = None

    @property
    def device(self) -> torch.device:
        return self.net.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.net.model.embed_tokens.weight.dtype

    @property
    def max_seq_len(self) -> int:
        return self.net.kv_cache.max_seq_len

    @property
    def max_batch_size(self) -> int:
        return self.net.kv_cache.max_batch_size

    @property
    def slots(self) -> Slots:
        """What each row of the cache holds (core/slots.py), shared by every engine over this
        model (`generate`, `stream`, the server's scheduler); new for a new cache
        (`net.setup_caches`) or a new tensor-parallel lead."""
        cache, lead = self.net.kv_cache, self.net.lead
        held = self._slots
        if held is None or held[0] is not cache or held[1] is not lead:
            held = self._slots = (cache, lead, Slots.of(self.net, cache.max_batch_size))
        return held[2]

    def forget(self) -> None:
        """Make what the cache rows hold unknown (nothing is reused): after writing the cache
        other than through the engine, e.g. calling `net` directly."""
        if self._slots is not None:
            self._slots[2].forget()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        start_pos: int | torch.Tensor = 0,
        lengths: Sequence[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab) for input_ids (B, T) at positions start_pos.. (an int, or one
        per row as a (B,) tensor), writing their keys and values into the cache.

        lengths: for rows right-padded to T, each row's real token count; sliding-window layers
        (whose ring buffers padding would overwrite) then store only those. None: all T."""
        b, t = input_ids.shape
        if b > self.max_batch_size:
            raise RequestError(
                f"batch of {b} exceeds max_batch_size={self.max_batch_size}; "
                f"pass load_model(..., max_batch_size={b})"
            )
        end = int(start_pos.max() if isinstance(start_pos, torch.Tensor) else start_pos) + t
        if end > self.max_seq_len:
            raise RequestError(
                f"positions up to {end} exceed the KV cache (max_seq_len={self.max_seq_len}); "
                f"pass load_model(..., max_seq_len={end})"
            )
        if lengths is not None:
            lengths = torch.as_tensor(lengths, device=self.device)
        self.forget()
        with kernel_errors():
            return self.net(input_ids.to(self.device), start_pos, lengths=lengths)

    def reset(self) -> None:
        """Clear the KV cache."""
        self.forget()
        self.net.kv_cache.reset()

    # --- embeddings ---------------------------------------------------------------------------
    @property
    def pooling(self) -> Pooling:
        """How `embed` pools: the checkpoint's sentence-transformers files, else by its kind
        (core/embedding.py); read once."""
        if self._pooling is None:
            self._pooling = read_pooling(self.path)
        return self._pooling

    @torch.inference_mode()
    def embed(
        self,
        texts: Prompt | list[Prompt],
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
    ) -> torch.Tensor:
        """Embeddings: a text (or token ids) -> (hidden,), a list of them -> (N, hidden), float32
        on the CPU: the final hidden states (after the final norm) pooled as `self.pooling`
        says, or as given ("mean", "last", "cls", "max", "mean_sqrt_len"; `normalize`: L2).
        Texts are encoded as prompts (with BOS); runs in cache rows [:max_batch_size]."""
        one = isinstance(texts, str) or bool(_ids(texts))  # [] is no texts, not empty ids
        items = [texts] if one else list(texts)
        if not items:
            raise RequestError("texts is an empty list; pass a text or a list of them")
        p = self.pooling
        modes = p.modes if pooling is None else (pooling,)
        p = Pooling(modes, p.normalize if normalize is None else normalize, "given")
        out = self.embed_ids([self.encode_prompt(x) for x in items], p)
        return out[0] if one else out

    @torch.inference_mode()
    def embed_ids(
        self, ids: list[list[int]], pooling: Pooling | None = None, row: int | None = None
    ) -> torch.Tensor:
        """Encoded texts -> (N, D) float32 embeddings on the CPU. row None: right-padded batches
        in rows [:max_batch_size]; a row: one text at a time in that row (the server's)."""
        if not ids:
            raise RequestError("no inputs to embed; pass a text or a list of them")
        empty = [i for i, x in enumerate(ids) if not x]
        if empty:
            raise RequestError(f"input {empty[0]} is empty; pass some text or token ids")
        long = [(i, len(x)) for i, x in enumerate(ids) if len(x) > self.max_seq_len]
        if long:
            i, n = long[0]
            raise RequestError(
                f"input {i} ({n} tokens) exceeds the context length ({self.max_seq_len} "
                f"tokens); shorten it or pass load_model(..., max_seq_len={n})"
            )
        p, out = pooling or self.pooling, []
        size = 1 if row is not None else self.max_batch_size
        if row is None:  # (a row: the server's, taken from its slots holding nothing)
            self.forget()
        with kernel_errors():
            for k in range(0, len(ids), size):
                # right-padded: causal rows never see padding
                batch, lens = right_padded(ids[k : k + size], self.device)
                hidden = self.net.hidden(batch, lengths=lens, row=row)
                out.append(p.apply(hidden, lens).cpu())
        return torch.cat(out)

    # --- generation ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Text is encoded (with BOS, no chat template); token ids are checked against the vocab."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{self.path} has no tokenizer; pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = _ids(prompt)
            if ids is None:
                raise RequestError("prompt must be a str or a list of token ids")
        if not ids:
            raise RequestError("prompt is empty; pass some text or at least one token id")
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad and isinstance(prompt, str):
            raise RequestError(self.foreign_tokenizer(bad))
        if bad:
            raise RequestError(
                f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {self.config.vocab_size})"
            )
        return ids

    def foreign_tokenizer(self, bad: list[int]) -> str:
        """The message for ids the model's own tokenizer gave past its vocabulary."""
        return (
            f"the tokenizer of {self.path} gives token id(s) {bad[:5]} past the model's "
            f"vocabulary (vocab_size {self.config.vocab_size}): it is not this model's tokenizer; "
            "put the checkpoint's own tokenizer files beside its weights"
        )

    def _start(
        self, prompts: list[Prompt], params: dict[str, Any]
    ) -> tuple[list[list[int]], SamplingParams]:
        p = SamplingParams.build(self.defaults, **params)
        bad = [t for t, _ in p.logit_bias if t >= self.config.vocab_size]
        if bad:
            raise RequestError(
                f"logit_bias token id(s) {bad[:5]} outside the vocabulary "
                f"[0, {self.config.vocab_size})"
            )
        ids = [self.encode_prompt(x) for x in prompts]
        if len(ids) > self.max_batch_size:
            raise RequestError(
                f"batch of {len(ids)} prompts exceeds max_batch_size={self.max_batch_size}; "
                f"pass load_model(..., max_batch_size={len(ids)})"
            )
        longest = max(len(x) for x in ids)
        if longest + p.max_new_tokens > self.max_seq_len:
            raise RequestError(
                f"prompt ({longest} tokens) + max_new_tokens ({p.max_new_tokens}) = "
                f"{longest + p.max_new_tokens} exceeds the KV cache (max_seq_len="
                f"{self.max_seq_len}); pass load_model(..., max_seq_len="
                f"{longest + p.max_new_tokens}) or ask for fewer tokens"
            )
        return ids, p

    def stop_ids(self, p: SamplingParams) -> set[int]:
        """The token ids that end a sequence sampled by `p`: its own, and eos unless ignored."""
        return set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)

    def token_loop(
        self,
        ids: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        *,
        cancelled: Callable[[int], bool] | None = None,
        on_token: Callable[[int, int, TokenLogprob | None], None] | None = None,
    ) -> Generator[tuple[int, str], None, list[GenerationResult]]:
        """Yield (row, text piece) as tokens arrive; return the results: the engine
        (`core.engine`) run over encoded prompts as one batch, with one SamplingParams for
        all rows or one per row; each row stops on its stop ids and the model's eos.
        `cancelled(row)` is asked before each of a row's tokens: True ends that row with
        finish_reason "abort". `on_token(row, token id, logprob or None)` sees each token as
        its row takes it, before the text it makes is yielded.

        Checks nothing: callers validate prompts and lengths first (as `generate` does), and
        iterate under `torch.inference_mode()`.

        With `prefix_cache`, each prompt starts from the longest prefix a row holds (`slots`);
        a failed step forgets what the rows hold, a loop closed early keeps it.
        """
        ps = params if isinstance(params, list) else [params] * len(ids)
        engine = Engine(self, self.max_batch_size, reuse=self.prefix_cache, slots=self.slots)
        pieces: list[tuple[int, str]] = []
        seqs = [
            _Row(i, pieces, cancelled, on_token, x, p, self.stop_ids(p), self.tokenizer,
                 self.config.vocab_size, self.device)
            for i, (x, p) in enumerate(zip(ids, ps, strict=True))
        ]  # fmt: skip
        try:
            _run(engine, seqs)
            while engine.running:
                _run(engine)
                yield from pieces
                pieces.clear()
        finally:  # (closed between steps: its rows hold what was fed)
            engine.clear(forget=False)
        timings = batch_timings(seqs)
        return [s.result(timings) for s in seqs]

    @torch.inference_mode()
    def generate(
        self, prompt: Prompt | list[Prompt], **params: Any
    ) -> GenerationResult | list[GenerationResult]:
        """Continue a prompt (str or token ids), or a list of them as one batch.

        params: see `core.sampling.SamplingParams`; defaults come from generation_config.json.
        `json_schema={...}` (or `json_object=True`) constrains the answer to JSON that matches
        the schema (any JSON object), as the OpenAI API's response_format does.
        A batch runs in one static-cache pass and returns one result per prompt.
        """
        batch = isinstance(prompt, list | tuple) and _ids(prompt) is None
        prompts = list(prompt) if batch else [prompt]
        if batch and not prompts:
            raise RequestError("prompt is an empty list; pass text, token ids or a list of them")
        loop = self.token_loop(*self._start(prompts, params))
        with kernel_errors():
            while True:
                try:
                    next(loop)
                except StopIteration as done:
                    results = done.value
                    break
        return results if batch else results[0]

    def stream(
        self,
        prompt: Prompt,
        *,
        on_token: Callable[[int, int, TokenLogprob | None], None] | None = None,
        **params: Any,
    ) -> TextStream:
        """Text pieces as they are generated; together they equal `generate(...).text`.

        The returned iterator's `.result` holds the `GenerationResult` once it is exhausted.
        `on_token(row, token id, logprob)` sees each token before the text it makes is yielded.
        """
        with torch.inference_mode():
            return TextStream(self.token_loop(*self._start([prompt], params), on_token=on_token))


def _run(engine: Engine, seqs: list[Seq] | None = None) -> None:
    """Admit seqs, or take one step; on any failure (Ctrl-C included) the rows' contents are
    unknown: forgotten."""
    try:
        if seqs is None:
            engine.step()
        else:
            engine.admit(seqs)
    except BaseException:
        engine.clear()
        raise


class _Row(Seq):
    """A row of `Model.token_loop`'s batch: its text pieces into the loop's list, its tokens
    and cancel check through the loop's callbacks (which take the row's index)."""

    def __init__(self, index: int, pieces: list, cancelled, on_token, *args):
        super().__init__(*args)
        self.index, self.pieces, self.cancel, self.callback = index, pieces, cancelled, on_token

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel(self.index)

    def on_token(self, token: int, logprob: TokenLogprob | None) -> None:
        if self.callback is not None:
            self.callback(self.index, token, logprob)

    def on_text(self, piece: str) -> None:
        self.pieces.append((self.index, piece))


class TextStream(Iterator[str]):
    """Iterates over text pieces of one generation; `.result` is set when it ends."""

    def __init__(self, loop: Generator[tuple[int, str], None, list[GenerationResult]]):
        self._loop = loop
        self.result: GenerationResult | None = None

    def __next__(self) -> str:
        with torch.inference_mode(), kernel_errors():
            try:
                return next(self._loop)[1]
            except StopIteration as done:
                self.result = done.value[0]
                raise

    def close(self) -> None:
        """Stop generating (e.g. on Ctrl-C); the KV cache needs no cleanup."""
        self._loop.close()
