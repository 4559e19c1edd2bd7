"""Prefix reuse across `Model.generate` / `stream` calls (load_model's `prefix_cache`): a chat's
next turn prefills only its new tokens, on an attention model (the tiny Llama, with a chat
tokenizer: streams have text) and on a
recurrent hybrid (its live state; fixtures/recurrent.py's slowly decaying one, which answers
wrong from a wrong state), with greedy tokens equal to a cold run's; a write outside the engine
forgets what the rows hold; a batch of fresh prompts still prefills in one padded forward."""

from __future__ import annotations

import pytest
import torch
from conftest import chat_llama_folder, make_checkpoint
from fixtures.recurrent import HYBRID, counted, slow_decay

from core import load_model

NEW = 8
GREEDY = dict(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> a model that keeps its rows (two) between calls; built when first asked for."""
    made = {}

    def get(kind: str):
        if kind not in made:
            root = tmp_path_factory.mktemp(kind)
            if kind == "attention":
                root = chat_llama_folder(root)
            else:
                root = slow_decay(make_checkpoint(root, HYBRID)[0])
            made[kind] = load_model(root, max_seq_len=128, max_batch_size=2)
        return made[kind]

    return get


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cold(model, prompt):
    """The answer of a run that reuses nothing."""
    model.prefix_cache = False
    try:
        return model.generate(prompt, **GREEDY)
    finally:
        model.prefix_cache = True


@pytest.mark.parametrize("kind", ["attention", "recurrent"])
def test_the_next_turn_prefills_only_its_new_tokens(models, kind, monkeypatch):
    """Turn 2 = turn 1's prompt, its answer and a new message: it resumes after everything
    turn 1 fed (its prompt and answer but the last token) and prefills only the rest."""
    model = models(kind)
    model.reset()
    history = tokens(30, 0)
    first = model.generate(history, **GREEDY)
    turn = history + first.token_ids + tokens(10, 1)
    calls = counted(model, monkeypatch)
    stream = model.stream(turn, **GREEDY)
    text = "".join(stream)
    again = stream.result
    held = len(history) + NEW - 1
    assert (first.cached_tokens, again.cached_tokens) == (0, held)
    assert calls == [len(turn) - held]  # the forward of the prompt's new tokens, alone
    assert first.token_ids == cold(model, history).token_ids
    assert again.token_ids == cold(model, turn).token_ids and text == again.text


def test_a_forward_between_calls_forgets_the_rows(models):
    """`Model.forward` writes row 0 outside the engine: the next turn reuses nothing (resumed
    from row 0's keys and values it would answer from the forward's prompt instead)."""
    model = models("attention")
    model.reset()
    history = tokens(30, 2)
    first = model.generate(history, **GREEDY)
    model.forward(torch.tensor([tokens(60, 3)]))
    turn = history + first.token_ids + tokens(10, 4)
    again = model.generate(turn, **GREEDY)
    assert again.cached_tokens == 0 and again.token_ids == cold(model, turn).token_ids


def test_a_fresh_batch_prefills_in_one_padded_forward(models, monkeypatch):
    """With a row holding a history no prompt of the batch shares, a ragged batch of two goes
    into rows 0 and 1 together: one forward, answers as with the prefix cache off."""
    model = models("attention")
    model.reset()
    model.generate([5, *tokens(20, 5)], **GREEDY)
    batch = [[6, *tokens(12, 6)], [7, *tokens(7, 7)]]
    calls = counted(model, monkeypatch)
    got = model.generate(batch, **GREEDY)
    assert calls == [13] and [r.cached_tokens for r in got] == [0, 0]
    want = cold(model, batch)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_each_row_of_a_batch_resumes_its_own_history(models, monkeypatch):
    """A ragged batch's next turn: each prompt resumes from the row its history is in."""
    model = models("attention")
    model.reset()
    batch = [[8, *tokens(12, 8)], [9, *tokens(7, 9)]]
    first = model.generate(batch, **GREEDY)
    turns = [
        p + r.token_ids + tokens(4, 10 + i)
        for i, (p, r) in enumerate(zip(batch, first, strict=True))
    ]
    calls = counted(model, monkeypatch)
    got = model.generate(turns, **GREEDY)
    held = [len(p) + NEW - 1 for p in batch]
    assert [r.cached_tokens for r in got] == held and calls == [5, 5]
    assert [r.token_ids for r in got] == [r.token_ids for r in cold(model, turns)]


def test_a_stream_closed_early_frees_its_row_and_keeps_what_it_fed(models):
    """A stream stopped between two steps (Ctrl-C in zoo chat while a piece prints) frees its
    row, which holds the prompt and the tokens fed so far: the next turn resumes from them."""
    model = models("attention")
    model.reset()
    history = tokens(30, 12)
    stream = model.stream(history, **GREEDY)
    next(stream)
    stream.close()
    assert not any(model.slots.busy)
    again = model.generate(history + tokens(5, 13), max_new_tokens=2, temperature=0.0)
    assert again.cached_tokens == len(history)


def test_a_failed_step_forgets_the_rows(models):
    """An error inside a step (here from a token callback) leaves the rows' contents unknown:
    they are freed and forgotten, and the next call prefills its whole prompt."""
    model = models("attention")
    model.reset()
    history = tokens(30, 14)

    def boom(row, token, logprob):
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        list(model.stream(history, on_token=boom, **GREEDY))
    assert not any(model.slots.busy)
    assert model.generate(history, **GREEDY).cached_tokens == 0
