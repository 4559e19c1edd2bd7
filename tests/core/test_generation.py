"""Model.generate / Model.stream on a tiny random Llama with a Llama 3 tokenizer folder, checked
against transformers (greedy tokens, logits, decode) and against the rules of each parameter."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import LLAMA32, make_checkpoint
from fixtures.chat_tokenizers import build_tokenizer_folder
from fixtures.replay import replay

from core import RequestError, load_model

PROMPT = "Why is the sky blue?"
OTHER = "天空 😀 hello"
MAX_NEW = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes: a second intra-op thread only adds synchronization (10x slower decode on a
    busy 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(folder, transformers model, transformers tokenizer, special ids) of a tiny Llama 3.2-style
    checkpoint whose vocabulary (320) covers its tokenizer's (307), as padded hub vocabs do."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("llama")
    special = build_tokenizer_folder(root, "llama3")
    assert special["vocab_size"] <= 320
    spec = dict(
        LLAMA32,
        vocab_size=320,
        bos_token_id=special["<|begin_of_text|>"],
        eos_token_id=special["<|end_of_text|>"],
    )
    root, ref = make_checkpoint(root, spec, seed=2)  # a seed whose greedy text varies
    prefer_whole_characters(root, ref)
    write_generation_config(root, {})
    return root, ref, AutoTokenizer.from_pretrained(root), special


def prefer_whole_characters(root, ref, scale: float = 0.3) -> None:
    """Shrink the (tied) embedding rows of tokens that are not whole UTF-8 text on their own
    (partial characters, special tokens, padding ids past the tokenizer), in the reference and
    the saved file alike: greedy output becomes readable text, as a trained model's is, and stop
    strings can be picked from it; sampling still draws the others now and then."""
    from safetensors.torch import load_file, save_file

    from core.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(root)
    texts = [tok.decode([i]) for i in range(ref.config.vocab_size)]
    partial = [i for i, text in enumerate(texts) if not text or "\ufffd" in text]
    with torch.no_grad():
        ref.get_output_embeddings().weight[partial] *= scale
    path = root / "model.safetensors"
    state = ref.state_dict()
    save_file({k: state[k].contiguous() for k in load_file(path)}, path, metadata={"format": "pt"})


def write_generation_config(root, gen: dict) -> None:
    (root / "generation_config.json").write_text(json.dumps(gen, indent=2))


def variant(base, tmp_path, *, config: dict | None = None, gen: dict | None = None):
    """A copy of the base checkpoint with config.json keys and generation_config.json replaced."""
    folder = tmp_path / "variant"
    shutil.copytree(base[0], folder)
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    if gen is not None:
        write_generation_config(folder, gen)
    return folder


@pytest.fixture(scope="module")
def model(base):
    return load_model(base[0])


@torch.no_grad()
def ref_greedy(ref, prompt_ids: list[int], n: int = MAX_NEW, **kw) -> list[int]:
    """transformers' greedy continuation, told never to stop early."""
    out = ref.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        **kw,
    )
    return out[0, len(prompt_ids) :].tolist()


def expected(base, prompt, **kw) -> list[int]:
    """The reference tokens (fixtures.replay: transformers' logits, the request's parameters,
    its seed) for a prompt given as text (encoded by transformers) or as token ids."""
    _, ref, hf, _ = base
    return replay(ref, hf.encode(prompt) if isinstance(prompt, str) else list(prompt), **kw)


def first_new(tokens: list[int], start: int) -> int:
    """The first step >= start whose token did not appear before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


# --- prompts and basic results ----------------------------------------------------------------
def test_str_and_token_prompts_match_transformers(base, model):
    _, ref, hf, special = base
    ids = hf.encode(PROMPT)
    assert ids[0] == special["<|begin_of_text|>"] and ids.count(ids[0]) == 1
    want = ref_greedy(ref, ids)
    from_text = model.generate(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True)
    from_ids = model.generate(ids, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert from_text.token_ids == from_ids.token_ids == want
    assert from_text.text == hf.decode(want, skip_special_tokens=True)
    assert from_text.finish_reason == "length"


def test_loaded_model_chats_with_its_own_template(base, model):
    """load_model picks up the folder's tokenizer and chat template; a chat prompt is token ids."""
    hf = base[2]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why is the sky blue?"},
    ]
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids == list(want["input_ids"] if not isinstance(want, list) else want)
    out = model.generate(ids, max_new_tokens=4, ignore_eos=True)
    assert out.usage["prompt_tokens"] == len(ids) and len(out.token_ids) == 4


def test_usage_counts(base, model):
    hf = base[2]
    out = model.generate(OTHER, max_new_tokens=7, ignore_eos=True)
    n_prompt = len(hf.encode(OTHER))
    assert out.usage == {
        "prompt_tokens": n_prompt,
        "completion_tokens": 7,
        "total_tokens": n_prompt + 7,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},  # (the prefix cache's)
    }
    assert len(out.token_ids) == 7


def test_timings_are_read_around_prefill_and_decode(base, model, monkeypatch):
    """The loop reads the clock before the prefill (t0), once the first token is on the host
    (t1) and after the last token (t2): time to first token t1 - t0, prefill tokens/s
    prompt tokens read (not cached) / (t1 - t0), decode tokens/s (new - 1) / (t2 - t1). With
    the real clock, both spans lie inside the call's own wall time."""
    import time
    from types import SimpleNamespace

    import core.generation

    n_prompt = len(base[2].encode(PROMPT))
    clock = iter([100.0, 100.25, 102.0])
    monkeypatch.setattr(core.generation, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    out = model.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    t = out.timings
    assert t == pytest.approx(
        {
            "time_to_first_token_s": 0.25,
            "prefill_tokens_per_s": (n_prompt - out.cached_tokens) / 0.25,
            "decode_tokens_per_s": 7 / 1.75,
        }
    )
    monkeypatch.undo()
    start = time.perf_counter()
    t = model.generate(PROMPT, max_new_tokens=8, ignore_eos=True).timings
    wall = time.perf_counter() - start
    assert (
        0
        < t["time_to_first_token_s"]
        < t["time_to_first_token_s"] + 7 / t["decode_tokens_per_s"]
        <= wall
    )


def test_max_new_tokens_is_length(base, model):
    want = ref_greedy(base[1], base[2].encode(PROMPT), 5)
    out = model.generate(PROMPT, max_new_tokens=5, ignore_eos=True)
    assert out.token_ids == want and out.finish_reason == "length"


def test_repetition_penalty_matches_transformers(base, model):
    _, ref, hf, _ = base
    ids = hf.encode(PROMPT)
    want = ref_greedy(ref, ids, repetition_penalty=1.5)
    assert want != ref_greedy(ref, ids)  # the penalty changes this continuation
    got = model.generate(ids, max_new_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.5)
    assert got.token_ids == want


# --- sampling ---------------------------------------------------------------------------------
def test_seeded_sampling_draws_what_the_seed_promises(base, model):
    """A seed gives the tokens transformers' logits and a generator of that seed give
    (fixtures.replay), every time; another seed others; no seed, fresh draws each call."""
    kw = dict(max_new_tokens=MAX_NEW, ignore_eos=True, temperature=1.0)
    want = {seed: expected(base, PROMPT, seed=seed, **kw) for seed in (1, 2)}
    assert want[1] != want[2]
    for seed in (1, 2, 1):
        assert model.generate(PROMPT, seed=seed, **kw).token_ids == want[seed]
    assert model.generate(PROMPT, **kw).token_ids != model.generate(PROMPT, **kw).token_ids


def test_sampled_tokens_are_in_the_filtered_set(base, model):
    """Every sampled token is among the top-k of transformers' logits at its step."""
    _, ref, hf, _ = base
    ids = hf.encode(PROMPT)
    out = model.generate(ids, max_new_tokens=16, ignore_eos=True, temperature=1.5, top_k=3, seed=5)
    with torch.no_grad():
        logits = ref(torch.tensor([ids + out.token_ids[:-1]])).logits[0, len(ids) - 1 :]
    top3 = logits.topk(3, dim=-1).indices.tolist()
    assert all(t in top for t, top in zip(out.token_ids, top3, strict=True))
    assert any(t != top[0] for t, top in zip(out.token_ids, top3, strict=True))  # not greedy


# --- stopping ---------------------------------------------------------------------------------
def greedy_text(base, prompt=PROMPT, n=MAX_NEW) -> tuple[list[int], str]:
    """transformers' greedy tokens for `prompt` and their text, decoded by transformers."""
    _, ref, hf, _ = base
    tokens = ref_greedy(ref, hf.encode(prompt), n)
    return tokens, hf.decode(tokens, skip_special_tokens=True)


def stop_strings(text: str) -> list[str]:
    """Stop strings that occur in `text` past its start: 1, 2 and 3 characters long."""
    out = []
    for length in (1, 2, 3):
        for i in range(len(text) // 3, len(text) - length):
            s = text[i : i + length]
            if text.find(s) > 0 and s.strip():
                out.append(s)
                break
    assert out, text
    return out


def test_stop_strings_cut_the_text(base, model):
    _, full = greedy_text(base)
    for stop in stop_strings(full):
        out = model.generate(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True, stop=stop)
        assert out.text == full[: full.index(stop)], stop
        assert stop not in out.text and out.finish_reason == "stop"
        # the loop stopped at the token that completed the stop string
        assert len(out.token_ids) < MAX_NEW
        assert stop in base[2].decode(out.token_ids, skip_special_tokens=True)
        pieces = list(model.stream(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True, stop=stop))
        assert "".join(pieces) == out.text
        assert all(stop not in p for p in pieces)


def test_earliest_of_several_stop_strings_wins(base, model):
    _, full = greedy_text(base)
    stops = stop_strings(full)
    first = min(stops, key=full.index)
    out = model.generate(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True, stop=stops[::-1])
    assert out.text == full[: full.index(first)]


def test_stop_string_never_seen_is_flushed(base, model):
    _, full = greedy_text(base)
    out = model.generate(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True, stop=["#@!never"])
    assert out.text == full and out.finish_reason == "length"


def test_stop_token_ids(base, model):
    tokens, _ = greedy_text(base)
    k = first_new(tokens, 3)
    out = model.generate(PROMPT, max_new_tokens=MAX_NEW, stop_token_ids=[tokens[k]])
    assert out.token_ids == tokens[: k + 1] and out.finish_reason == "stop"
    # the stop token's own text is not part of the result; held-back text is flushed
    hf = base[2]
    assert out.text == hf.decode(tokens[:k], skip_special_tokens=True)
    held = model.generate(PROMPT, max_new_tokens=MAX_NEW, stop_token_ids=[tokens[k]], stop="~~~~")
    assert held.text == out.text


def test_eos_from_config_json(base, tmp_path):
    tokens, _ = greedy_text(base)
    k = first_new(tokens, 2)
    m = load_model(variant(base, tmp_path, config={"eos_token_id": tokens[k]}))
    out = m.generate(PROMPT, max_new_tokens=MAX_NEW)
    assert out.token_ids == tokens[: k + 1] and out.finish_reason == "stop"
    # ignore_eos runs to the length limit, past it
    out = m.generate(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert out.token_ids == tokens and out.finish_reason == "length"


def test_eos_from_generation_config_json(base, tmp_path):
    tokens, _ = greedy_text(base)
    special = base[3]
    j = first_new(tokens, 2)
    k = first_new(tokens, j + 1)
    never = special["<|end_of_text|>"]
    assert never not in tokens
    gen = {"eos_token_id": [never, special["<|eot_id|>"], tokens[k]]}  # a list, as Llama 3.1's
    m = load_model(variant(base, tmp_path, gen=gen))
    assert {never, special["<|eot_id|>"], tokens[k]} <= m.eos_token_ids
    out = m.generate(PROMPT, max_new_tokens=MAX_NEW)
    assert out.token_ids == tokens[: k + 1] and out.finish_reason == "stop"
    # both files at once: whichever eos comes first stops it
    m = load_model(variant(base, tmp_path / "both", config={"eos_token_id": tokens[j]}, gen=gen))
    assert m.generate(PROMPT, max_new_tokens=MAX_NEW).token_ids == tokens[: j + 1]


# --- generation_config.json defaults ----------------------------------------------------------
def test_generation_config_defaults_used_and_overridable(base, tmp_path):
    tokens, _ = greedy_text(base)
    m = load_model(variant(base, tmp_path, gen={"do_sample": False, "max_new_tokens": 5}))
    out = m.generate(PROMPT, ignore_eos=True)
    assert out.token_ids == tokens[:5] and out.finish_reason == "length"
    assert m.generate(PROMPT, ignore_eos=True, max_new_tokens=8).token_ids == tokens[:8]


def test_generation_config_sampling_defaults(base, tmp_path):
    gen = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.3}
    sampled = load_model(variant(base, tmp_path / "a", gen=gen))
    plain = load_model(variant(base, tmp_path / "b", gen={}))
    kw = dict(max_new_tokens=16, ignore_eos=True, seed=3)
    got = sampled.generate(PROMPT, **kw).token_ids
    assert got == expected(base, PROMPT, temperature=0.6, top_p=0.9, repetition_penalty=1.3, **kw)
    explicit = plain.generate(PROMPT, temperature=0.6, top_p=0.9, repetition_penalty=1.3, **kw)
    assert got == explicit.token_ids
    tokens, _ = greedy_text(base, n=16)
    assert plain.generate(PROMPT, **kw).token_ids == tokens != got  # plain: greedy by default
    # request parameters win over the file's
    assert sampled.generate(PROMPT, temperature=0, repetition_penalty=1.0, **kw).token_ids == (
        tokens
    )


# --- logprobs ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [{}, {"temperature": 1.0, "seed": 4}, {"repetition_penalty": 1.5, "presence_penalty": 1.0}],
    ids=["greedy", "sampled", "penalized"],
)
def test_logprobs_equal_transformers_log_softmax(base, model, kw):
    """The model's own log-probabilities, before penalties and sampling filters (as vLLM's)."""
    _, ref, hf, _ = base
    ids = hf.encode(OTHER)
    out = model.generate(ids, max_new_tokens=10, ignore_eos=True, logprobs=3, **kw)
    assert out.logprobs is not None and len(out.logprobs) == 10
    with torch.no_grad():
        logits = ref(torch.tensor([ids + out.token_ids[:-1]])).logits[0, len(ids) - 1 :]
    want = logits.log_softmax(dim=-1)  # (10, V): the step that chose each token
    for step, (lp, tok) in enumerate(zip(out.logprobs, out.token_ids, strict=True)):
        assert lp.token_id == tok
        assert abs(lp.logprob - want[step, tok].item()) < 1e-4
        top = want[step].topk(3)
        assert list(lp.top) == top.indices.tolist()
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert abs(lp.top[t] - v) < 1e-4
        assert lp.logprob <= max(lp.top.values()) + 1e-6
    assert model.generate(ids, max_new_tokens=3).logprobs is None
    zero = model.generate(ids, max_new_tokens=3, logprobs=0).logprobs
    assert len(zero) == 3 and all(lp.top == {} for lp in zero)


# --- streaming --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"temperature": 1.0, "seed": 7},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 8, "presence_penalty": 0.5},
    ],
    ids=["greedy", "seeded", "seeded-filtered"],
)
@pytest.mark.parametrize("prompt", [PROMPT, OTHER])
def test_stream_equals_generate(base, model, kw, prompt):
    hf = base[2]
    kw = dict(max_new_tokens=MAX_NEW, ignore_eos=True, **kw)
    out = model.generate(prompt, **kw)
    pieces = list(model.stream(prompt, **kw))
    assert "".join(pieces) == out.text == hf.decode(out.token_ids, skip_special_tokens=True)
    assert len([p for p in pieces if p]) > 1  # it streams, not one piece at the end
    # with a stop string taken from this very text
    stop = stop_strings(out.text)[-1]
    cut = model.generate(prompt, stop=stop, **kw)
    assert cut.text == out.text[: out.text.index(stop)] and cut.finish_reason == "stop"
    assert "".join(model.stream(prompt, stop=stop, **kw)) == cut.text


def test_stream_validates_before_yielding(model):
    with pytest.raises(RequestError, match="top_p"):
        next(model.stream(PROMPT, top_p=2.0))


# --- batching ---------------------------------------------------------------------------------
BATCH = [PROMPT, "Hi", list(range(40, 52)), OTHER]


@pytest.fixture(scope="module")
def model4(base):
    return load_model(base[0], max_batch_size=4)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"temperature": 1.0, "seed": 11},
        {"temperature": 0.9, "top_p": 0.8, "seed": 12, "frequency_penalty": 0.4},
        {"repetition_penalty": 1.4, "logprobs": 2},
    ],
    ids=["greedy", "seeded", "filtered-penalized", "repetition-logprobs"],
)
def test_batch_equals_each_prompt_alone(base, model, model4, kw):
    kw = dict(max_new_tokens=12, ignore_eos=True, **kw)
    batch = model4.generate(BATCH, **kw)
    assert isinstance(batch, list) and len(batch) == len(BATCH)
    for prompt, got in zip(BATCH, batch, strict=True):
        alone = model.generate(prompt, **kw)
        assert got.token_ids == alone.token_ids == expected(base, prompt, **kw)
        assert got.text == alone.text and got.finish_reason == alone.finish_reason
        assert got.prompt_tokens == alone.prompt_tokens  # (cached tokens: each model's own)
        if kw.get("logprobs"):
            for a, b in zip(got.logprobs, alone.logprobs, strict=True):
                assert abs(a.logprob - b.logprob) < 1e-4


def test_each_row_stops_on_its_own(base, model, model4):
    tokens = expected(base, BATCH[0], max_new_tokens=16)
    kw = dict(max_new_tokens=16, stop_token_ids=[tokens[first_new(tokens, 2)]])
    batch = model4.generate(BATCH, **kw)
    alone = [model.generate(p, **kw) for p in BATCH]
    stop = {*kw["stop_token_ids"], *model.eos_token_ids}
    want = [expected(base, p, max_new_tokens=16, stop_ids=stop) for p in BATCH]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone] == want
    assert [r.finish_reason for r in batch] == [r.finish_reason for r in alone]
    assert batch[0].finish_reason == "stop" and len(batch[0].token_ids) < 16
    assert len({len(r.token_ids) for r in batch}) > 1  # rows ended at different steps


def test_batch_with_stop_strings(base, model, model4):
    hf = base[2]
    full = [
        hf.decode(expected(base, p, max_new_tokens=16), skip_special_tokens=True) for p in BATCH
    ]
    stop = stop_strings(full[0])[0]
    kw = dict(max_new_tokens=16, ignore_eos=True, stop=[stop])
    batch = model4.generate(BATCH, **kw)
    assert [r.text for r in batch] == [model.generate(p, **kw).text for p in BATCH]
    assert [r.text for r in batch] == [t[: t.index(stop)] if stop in t else t for t in full]
    assert batch[0].finish_reason == "stop"


class PerRowReference:
    """`forward(ids, start_pos)` with exact per-row cache semantics, recomputed from scratch by
    transformers: row b's tokens at positions start_pos[b].. replace whatever its history held
    there (the right padding of a shorter prompt) and drop what followed."""

    def __init__(self, ref):
        self.ref, self.rows = ref, None

    @torch.no_grad()
    def __call__(
        self, ids: torch.Tensor, start_pos, end=None, logits_at=None, lengths=None
    ) -> torch.Tensor:
        b, t = ids.shape
        starts = start_pos.tolist() if isinstance(start_pos, torch.Tensor) else [start_pos] * b
        self.rows = self.rows or [[] for _ in range(b)]
        out = []
        for row, start in enumerate(starts):
            self.rows[row] = self.rows[row][:start] + ids[row].tolist()
            out.append(self.ref(torch.tensor([self.rows[row]])).logits[0, start : start + t])
        logits = torch.stack(out)
        if logits_at is not None:
            return logits[torch.arange(b), logits_at][:, None]
        return logits

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, end: int) -> torch.Tensor:
        assert int(positions.max()) < end  # the loop's host-side bound holds
        return self(tokens[:, None], positions)[:, -1]


def run_loop(base, prompts, per_row: list[dict] | None = None, hooks: dict | None = None, **kw):
    """The engine's token loop over the per-row reference: one set of parameters `kw`, or one
    per row; `hooks`: Model.token_loop's cancelled / on_token, and `ahead`. Returns (results,
    streamed text per row)."""
    from types import SimpleNamespace

    from core.model import Model
    from core.sampling import SamplingParams
    from core.tokenizer import Tokenizer

    root, ref, hf, _ = base
    ids = [hf.encode(x) if isinstance(x, str) else x for x in prompts]
    p = [SamplingParams(ignore_eos=True, **x) for x in per_row or [kw] * len(ids)]
    hooks = dict(hooks or {})
    reference = PerRowReference(ref)
    model = SimpleNamespace(  # what Model.token_loop reads of a model
        net=reference,
        step=reference.step,
        device=torch.device("cpu"),
        ahead=hooks.pop("ahead", False),
        config=SimpleNamespace(vocab_size=ref.config.vocab_size),
        tokenizer=Tokenizer.from_folder(root),
        max_batch_size=len(ids),
        stop_ids=lambda p: set(p.stop_token_ids),
        prefix_cache=False,
        slots=None,  # (the engine's own)
    )
    loop = Model.token_loop(model, ids, p, **hooks)
    pieces = [[] for _ in prompts]
    while True:
        try:
            row, piece = next(loop)
            pieces[row].append(piece)
        except StopIteration as done:
            return done.value, ["".join(x) for x in pieces]


def model_loop(model, ids: list[list[int]], params: list) -> list:
    """Model.token_loop over encoded prompts with per-row params, run to its end: the results."""
    with torch.inference_mode():
        loop = model.token_loop(ids, params)
        while True:
            try:
                next(loop)
            except StopIteration as done:
                return done.value


@pytest.mark.parametrize(
    "kw",
    [
        {"max_new_tokens": 12},
        {"max_new_tokens": 12, "temperature": 1.0, "seed": 11, "frequency_penalty": 0.4},
        {"max_new_tokens": 16, "stop_token_ids": "row 0's", "repetition_penalty": 1.2},
        {"max_new_tokens": 12, "logprobs": 2, "stop": "row 0's"},
    ],
    ids=["greedy", "seeded-penalized", "stop-token", "stop-string-logprobs"],
)
def test_loop_batches_rows_by_their_own_positions(base, kw):
    """The token loop alone, over a per-row reference forward: a batch of unequal prompts gives
    each row what it gives alone (the layers' per-row positions are tested apart)."""
    if "stop_token_ids" in kw or "stop" in kw:  # one that row 0 meets early, alone
        plain = {k: v for k, v in kw.items() if k not in ("stop", "stop_token_ids")}
        (first,), _ = run_loop(base, BATCH[:1], **plain)
        tokens = first.token_ids
        if "stop" in kw:
            kw["stop"] = stop_strings(first.text)[:1]
        else:
            kw["stop_token_ids"] = (tokens[first_new(tokens, 2)],)
    batch, streamed = run_loop(base, BATCH, **kw)
    for prompt, got, text in zip(BATCH, batch, streamed, strict=True):
        (alone,), _ = run_loop(base, [prompt], **kw)
        assert got.token_ids == alone.token_ids and got.finish_reason == alone.finish_reason
        assert got.text == alone.text == text
        # and what it gives alone is the reference's (a stop string: its text, cut there)
        want = expected(base, prompt, stop_ids=set(kw.get("stop_token_ids", ())), **kw)
        if "stop" in kw:
            full = base[2].decode(want, skip_special_tokens=True)
            assert got.text == (
                full[: full.index(kw["stop"][0])] if kw["stop"][0] in full else full
            )
        else:
            assert got.token_ids == want
        if kw.get("logprobs"):
            assert [x.logprob for x in got.logprobs] == pytest.approx(
                [x.logprob for x in alone.logprobs], abs=1e-5
            )
    if "stop_token_ids" in kw or "stop" in kw:
        assert batch[0].finish_reason == "stop"
        assert len({len(r.token_ids) for r in batch}) > 1  # rows ended at different steps


# one batch, one SamplingParams per row (as the server batches its requests)
PER_ROW = [
    dict(max_new_tokens=12),
    dict(max_new_tokens=9, temperature=1.0, seed=11, frequency_penalty=0.4, logprobs=1),
    dict(max_new_tokens=16, temperature=0.9, top_p=0.8, top_k=20, seed=12, repetition_penalty=1.2),
    dict(max_new_tokens=5, presence_penalty=1.0, logprobs=3),
]


def test_loop_rows_with_their_own_params(base):
    batch, streamed = run_loop(base, BATCH, per_row=PER_ROW)
    for prompt, kw, got, text in zip(BATCH, PER_ROW, batch, streamed, strict=True):
        (alone,), _ = run_loop(base, [prompt], **kw)
        assert got.token_ids == alone.token_ids and got.text == alone.text == text
        assert got.token_ids == expected(base, prompt, **kw)
        assert len(got.token_ids) == kw["max_new_tokens"]
        if "logprobs" in kw:
            assert [len(x.top) for x in got.logprobs] == [kw["logprobs"]] * len(got.token_ids)
            assert [x.logprob for x in got.logprobs] == pytest.approx(
                [x.logprob for x in alone.logprobs], abs=1e-5
            )
        else:
            assert got.logprobs is None


def test_model_batch_with_per_row_params(base, model, model4):
    """The same through the real forward: Model.token_loop with per-row params, each row equal to
    Model.generate alone (eos obeyed by all but one row, which ignores it)."""
    from core.sampling import SamplingParams

    per_row = [*PER_ROW[:3], dict(PER_ROW[3], ignore_eos=True)]
    ids = [model4.encode_prompt(x) for x in BATCH]
    params = [SamplingParams.build(model4.defaults, **kw) for kw in per_row]
    batch = model_loop(model4, ids, params)
    for prompt, kw, got in zip(BATCH, per_row, batch, strict=True):
        alone = model.generate(prompt, **kw)
        assert got.token_ids == alone.token_ids and got.text == alone.text
        assert got.finish_reason == alone.finish_reason
        stop = set() if kw.get("ignore_eos") else model.eos_token_ids
        assert got.token_ids == expected(base, prompt, stop_ids=stop, **kw)


def test_cancelled_row_stops_and_the_others_go_on(base):
    """cancelled(row) ends that row at once ("abort"); the batch ends when every row has."""
    taken = [0] * len(BATCH)

    def on_token(row, token, logprob):
        taken[row] += 1

    hooks = dict(on_token=on_token, cancelled=lambda row: row == 1 and taken[1] >= 3)
    batch, _ = run_loop(base, BATCH, hooks=hooks, max_new_tokens=12)
    for row, (prompt, got) in enumerate(zip(BATCH, batch, strict=True)):
        (alone,), _ = run_loop(base, [prompt], max_new_tokens=12)
        assert alone.token_ids == expected(base, prompt, max_new_tokens=12)
        if row == 1:
            assert got.finish_reason == "abort" and got.token_ids == alone.token_ids[:3]
        else:
            assert got.token_ids == alone.token_ids and got.finish_reason == "length"
        assert taken[row] == len(got.token_ids)
    # every row cancelled after its 2nd token: the loop ends there, not at max_new_tokens
    taken = [0] * len(BATCH)
    hooks = dict(on_token=on_token, cancelled=lambda row: taken[row] >= 2)
    batch, _ = run_loop(base, BATCH, hooks=hooks, max_new_tokens=12)
    assert [len(r.token_ids) for r in batch] == [2] * len(BATCH)
    assert {r.finish_reason for r in batch} == {"abort"}


def test_launching_steps_ahead_changes_nothing(base):
    """ahead=True launches step n+1 before the host reads step n's tokens (the order of
    calls shows it) and returns, streams and calls back exactly what it does in step, also
    as rows end at different times (their own lengths, a cancel)."""
    events = {}

    def loop(ahead: bool):
        log = events[ahead] = []
        hooks = dict(
            ahead=ahead,
            on_token=lambda row, token, lp: log.append(("token", row, token)),
            cancelled=lambda row: row == 2 and sum(e[:2] == ("token", 2) for e in log) >= 2,
        )
        return run_loop(base, BATCH, per_row=PER_ROW, hooks=hooks)

    (ahead, ahead_text), (inline, inline_text) = loop(True), loop(False)
    assert ahead_text == inline_text and events[True] == events[False]
    for a, b in zip(ahead, inline, strict=True):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.logprobs == b.logprobs
    for row, (prompt, kw, got) in enumerate(zip(BATCH, PER_ROW, inline, strict=True)):
        want = expected(base, prompt, **kw)
        assert got.token_ids == (want[:2] if row == 2 else want)  # row 2: cancelled after 2
    assert [r.finish_reason for r in inline] == ["length", "length", "abort", "length"]


def test_ahead_launches_the_next_step_before_reading_tokens(base, monkeypatch):
    order = []
    step = PerRowReference.step
    monkeypatch.setattr(PerRowReference, "step", lambda *a: order.append("step") or step(*a))
    for ahead in (False, True):
        order.clear()
        run_loop(base, [PROMPT], hooks=dict(
            ahead=ahead, on_token=lambda row, token, lp: order.append("token")
        ), max_new_tokens=3)  # fmt: skip
        want = ["token", "step", "token", "step", "token"]
        assert order == (["step", "token", "step", "token", "token"] if ahead else want)


def test_model_launching_ahead_equals_stepping(base, model4, monkeypatch):
    """Through the real forward and KV cache, rows ending at different steps."""
    from core.sampling import SamplingParams

    ids = [model4.encode_prompt(x) for x in BATCH]
    params = [SamplingParams.build(model4.defaults, **kw, ignore_eos=True) for kw in PER_ROW]
    got = {}
    for ahead in (False, True):
        monkeypatch.setattr(model4, "ahead", ahead)
        got[ahead] = [(r.token_ids, r.text, r.logprobs) for r in model_loop(model4, ids, params)]
    assert got[True] == got[False]
    assert [r[0] for r in got[False]] == [
        expected(base, x, **kw) for x, kw in zip(BATCH, PER_ROW, strict=True)
    ]
    assert [len(r[0]) for r in got[True]] == [kw["max_new_tokens"] for kw in PER_ROW]


@pytest.mark.parametrize("ahead", [False, True])
def test_rows_of_unequal_reach_fill_a_tight_cache(base, ahead):
    """A long prompt that wants few tokens beside a short one that wants many (as a server wave
    takes them): every row fits the cache on its own, and the batch must too, eager, with
    one step launched ahead or not."""
    from core.sampling import SamplingParams

    m = load_model(base[0], max_batch_size=2, max_seq_len=40)
    m.ahead = ahead
    ids = [list(range(40, 70)), [40, 41, 42]]  # 30 + 5 and 3 + 37 tokens: both exactly fit
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (5, 37)]
    batch = model_loop(m, ids, params)
    for prompt, p, got in zip(ids, params, batch, strict=True):
        alone = m.generate(prompt, max_new_tokens=p.max_new_tokens, ignore_eos=True)
        assert got.token_ids == alone.token_ids and len(got.token_ids) == p.max_new_tokens
        assert got.token_ids == expected(base, prompt, max_new_tokens=p.max_new_tokens)


def test_batch_larger_than_max_batch_size(model, model4):
    with pytest.raises(RequestError, match="max_batch_size=1"):
        model.generate([PROMPT, "Hi"], max_new_tokens=2)
    with pytest.raises(RequestError, match="max_batch_size=4"):
        model4.generate([PROMPT] * 5, max_new_tokens=2)


def test_batch_of_one_is_a_list(base, model):
    out = model.generate([PROMPT], max_new_tokens=3, ignore_eos=True)
    assert isinstance(out, list) and len(out) == 1
    assert out[0].token_ids == model.generate(PROMPT, max_new_tokens=3, ignore_eos=True).token_ids
    assert out[0].token_ids == expected(base, PROMPT, max_new_tokens=3)
