"""Prefix reuse for recurrent rows (core/slots.py, the cache's snapshots) on two tiny hybrids, one
per recurrent kind: gated DeltaNet (Qwen3-Next: three linear layers, one attention layer) and
Mamba2 (Granite 4.0-H: three Mamba2 layers, one attention layer): a prompt resumes from a row's
whole history, from a snapshot of its state inside the shared prefix, or from another row's,
and answers exactly as a cold run (greedy tokens, fp32) on a model that reuses nothing.

Snapshots every 16 tokens, 3 per row, so that short prompts cross several boundaries and a
row's slots fill up and thin out. The state decays slowly (fixtures/recurrent.py): a prompt
resumed from a wrong state answers wrong."""

from __future__ import annotations

import pytest
import torch
from conftest import make_checkpoint
from fixtures.recurrent import HYBRID, counted, slow_decay

from core import RequestError, load_model
from core.engine import Engine
from core.generation import Seq
from core.sampling import SamplingParams

VOCAB, ROWS, SEQ, EVERY, KEEP = 96, 2, 256, 16, 3
MAMBA2 = dict(
    model_type="granitemoehybrid", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
    shared_intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, num_local_experts=0, num_experts_per_tok=0,
    layer_types=["mamba"] * 3 + ["attention"], mamba_n_heads=2, mamba_d_head=16,
    mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=16, mamba_expand=1,
    max_position_embeddings=SEQ, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


@pytest.fixture(scope="module", params=["gated_deltanet", "mamba2"])
def models(request, tmp_path_factory):
    """(warm: snapshots every EVERY tokens, KEEP per row; cold: no snapshots, reuses nothing)."""
    spec = HYBRID if request.param == "gated_deltanet" else MAMBA2
    root = slow_decay(make_checkpoint(tmp_path_factory.mktemp(request.param), spec)[0])
    warm = load_model(root, max_seq_len=SEQ, max_batch_size=ROWS)
    warm.net.setup_caches(ROWS, SEQ, snapshots=KEEP, snapshot_interval=EVERY)
    return warm, load_model(root, max_seq_len=SEQ, max_batch_size=ROWS, snapshots=0)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def seq(model, ids: list[int], new: int) -> Seq:
    p = SamplingParams.build(model.defaults, max_new_tokens=new, temperature=0.0, ignore_eos=True)
    return Seq(ids, p, set(), None, VOCAB, model.device)


def finish(engine: Engine, *seqs: Seq) -> list[list[int]]:
    while engine.running:
        engine.step()
    return [s.out for s in seqs]


def cold(models, ids: list[int], new: int) -> list[int]:
    engine = Engine(models[1], ROWS)
    s = seq(models[1], ids, new)
    engine.add(s)
    return finish(engine, s)[0]


def answer(engine: Engine, ids: list[int], new: int = 6) -> Seq:
    s = seq(engine.model, ids, new)
    engine.add(s)
    finish(engine, s)
    return s


def test_next_turn_resumes_after_the_whole_history(models):
    """A second chat turn extends everything the row fed: it resumes from the live state."""
    engine = Engine(models[0], ROWS, reuse=True)
    history = tokens(100, 0)
    first = answer(engine, history)
    turn = history + first.out + tokens(10, 1)
    again = answer(engine, turn)
    assert first.cached == 0 and again.cached == len(history) + len(first.out) - 1
    assert first.out == cold(models, history, 6) and again.out == cold(models, turn, 6)


def test_a_diverging_prompt_resumes_from_a_snapshot(models, monkeypatch):
    """A prompt sharing 70 tokens of a 106-token history resumes at the snapshot at 64 (of
    32, 64, 96: every 16 tokens, thinned to every 32 once 3 were kept) and prefills 26."""
    engine = Engine(models[0], ROWS, reuse=True)
    history = tokens(100, 2)
    answer(engine, history)
    assert sorted(engine.slots.snaps[0]) == [32, 64, 96]
    prompt = history[:70] + tokens(20, 3)
    calls = counted(models[0], monkeypatch)
    got = answer(engine, prompt)
    assert got.cached == 64 and sum(calls) == len(prompt) - 64
    assert got.out == cold(models, prompt, 6)
    assert sorted(engine.slots.snaps[0]) == [32, 64]  # those past the resume point: dropped


def test_a_busy_rows_prefix_is_copied_with_its_snapshot(models):
    """A request sharing 50 tokens with a row that is still decoding gets that row's prefix
    and its snapshot at 48 copied into the free row; both answer as cold runs."""
    engine = Engine(models[0], ROWS, reuse=True)
    long, new = tokens(60, 4), None
    a = seq(models[0], long, 30)
    engine.add(a)
    for _ in range(3):
        engine.step()
    new = seq(models[0], long[:50] + tokens(9, 5), 6)
    engine.add(new)
    finish(engine, a, new)
    assert (a.row, new.row, new.cached) == (0, 1, 48)
    assert a.out == cold(models, long, 30) and new.out == cold(models, new.ids, 6)


def test_placeholders_never_reach_a_held_state(models, monkeypatch):
    """Row 1 decodes while row 0, free, holds a history: a decode step over rows [:2] (not the
    fused CPU step's chosen rows) feeds row 0 a placeholder, so the next turn resumes from its
    snapshot (at 96, not 105); then row 0 takes a placeholder again while it waits to prefill,
    and its restored state is kept."""
    monkeypatch.setattr(models[0].step, "takes_rows", None, raising=False)
    engine = Engine(models[0], ROWS, reuse=True)
    history = tokens(100, 6)
    first = answer(engine, history)
    other = seq(models[0], tokens(20, 7), 30)
    engine.add(other)
    engine.step(), engine.step()  # row 1 decodes; row 0 takes placeholders
    turn = history + first.out + tokens(10, 8)
    again = seq(models[0], turn, 6)
    engine.add(again)
    finish(engine, other, again)
    assert (again.row, again.cached) == (0, 96)
    assert again.out == cold(models, turn, 6) and other.out == cold(models, other.ids, 30)


def test_snapshots_are_bounded_and_hold_the_state_at_their_position(models):
    """A 250-token prompt keeps KEEP snapshots, thinned evenly (every 64 tokens by then), and
    the one at 128 is the recurrent state a cold prefill of those 128 tokens leaves."""
    warm, model = models
    engine = Engine(warm, ROWS, reuse=True)
    ids = tokens(250, 9)
    answer(engine, ids, 1)
    snaps = engine.slots.snaps[0]
    assert sorted(snaps) == [64, 128, 192] and engine.slots.stride[0] == 64
    model.net(torch.tensor([ids[:128]]), 0, row=0)
    for (_, snap), live in zip(warm.net.kv_cache.states, model.net.kv_cache.live_states,
                               strict=True):  # fmt: skip
        # (prefilled in 16-token pieces, against one 128-token forward: fp32 rounding)
        assert (snap[0, snaps[128]] - live[0]).abs().max() <= 1e-4 * live[0].abs().max()
    state = warm.config.state_bytes_per_sequence(4)
    assert warm.net.kv_cache.snapshot_bytes == KEEP * state
    assert model.net.kv_cache.snapshot_bytes == 0  # snapshots=0: none allocated


def test_snapshots_must_not_be_negative(models):
    with pytest.raises(RequestError, match="snapshots"):
        load_model(models[1].path, snapshots=-1)


@pytest.mark.parametrize(("snapshots", "every"), [(-1, 16), (3, 0)])
def test_bad_snapshot_settings_are_refused_before_the_cache_is_replaced(models, snapshots, every):
    """setup_caches with a negative count or an interval under one token: a RequestError
    naming both (an interval of 0 used to fail mid-serving, at the first snapshot's modulo),
    and the model keeps the cache it had."""
    cache = models[0].net.kv_cache
    with pytest.raises(RequestError, match=r"snapshots .* snapshot_interval"):
        models[0].net.setup_caches(ROWS, SEQ, snapshots=snapshots, snapshot_interval=every)
    assert models[0].net.kv_cache is cache


def test_an_automatic_cache_length_leaves_room_for_the_snapshots(models, monkeypatch):
    """On CPUs without max_seq_len, the cache is sized to what fits beside the weights: the
    snapshots' bytes come off that budget too (else the length chosen could overrun the memory
    check that counts them)."""
    from core import api

    cfg, kv = models[0].config, torch.float32
    token, state = cfg.kv_bytes_per_token(4), cfg.state_bytes_per_sequence(4)
    spare = api.FIT_SPARE + cfg.kv_bytes(4, 0, ROWS) + 250 * ROWS * token  # 250 tokens a row
    monkeypatch.setattr(api, "available_memory", lambda device: int(spare / api.FIT_SHARE) + 1)
    dev = torch.device("cpu")
    assert api._cache_length(cfg, 0, kv, dev, ROWS, None) == 250
    room = (250 * token - KEEP * state) // token  # 25 (gated DeltaNet), 137 (Mamba2)
    assert 0 < room < 250 and api._cache_length(cfg, 0, kv, dev, ROWS, None, KEEP) == room


def test_a_cache_too_large_names_the_snapshots_among_the_fixes(models, monkeypatch):
    from core import api

    monkeypatch.setattr(api, "available_memory", lambda device: 1 << 10)
    with pytest.raises(RequestError, match=r"max_batch_size \(or fewer snapshots\)"):
        load_model(models[1].path, max_seq_len=SEQ, max_batch_size=ROWS, snapshots=KEEP)
