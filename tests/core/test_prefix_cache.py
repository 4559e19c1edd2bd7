"""Prefix reuse across `Model.generate` / `stream` calls (load_model's `prefix_cache`): a chat's
next turn prefills only its new tokens, on an attention model (the tiny Llama) and on a
recurrent hybrid (its live state; fixtures/recurrent.py's slowly decaying one, which answers
wrong from a wrong state), with greedy tokens equal to a cold run's; a write outside the engine
forgets what the rows hold; a batch of fresh prompts still prefills in one padded forward."""

from __future__ import annotations

import pytest
import torch
from conftest import LLAMA32, make_checkpoint
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
            spec = LLAMA32 if kind == "attention" else HYBRID
            root = make_checkpoint(tmp_path_factory.mktemp(kind), spec)[0]
            root = root if kind == "attention" else slow_decay(root)
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
