"""Speculative decoding's mechanism (core/spec_step.py, core/speculative.py, the cache's
keep / rewind) on four kinds of tiny model: full attention (Llama 3.2 with a chat tokenizer),
sliding windows (Mistral v0.1, window 8: the drafts' writes wrap its ring), MLA (DeepSeek V3)
and a recurrent hybrid (Qwen3-Next: gated DeltaNet, state that decays slowly, so a state not
rolled back answers wrong).

The drafts come from a scripted proposer that knows the plain greedy answer and spoils one
drafted token at a random place (or none): every verify then accepts a known number of drafts
and rolls the rest back at every point of the ring / state. Greedy answers must be token for
token those of plain decoding, alone, as a batch, and beside rows that draft nothing. Prompt
lookup (`NgramProposer`) runs on the same models."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import LLAMA32, chat_llama_folder, make_checkpoint
from fixtures.fused_steps import deepseek_checkpoint
from fixtures.recurrent import HYBRID, slow_decay

from core import load_model
from core.engine import Engine
from core.generation import Seq
from core.sampling import SamplingParams
from core.speculative import Draft, Proposer, SpecConfig, Speculator, make_speculator

SEQ, ROWS = 160, 3
MISTRAL_WINDOW = dict(
    model_type="mistral", vocab_size=96, hidden_size=48, intermediate_size=80,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
    max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=8,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
DEEPSEEK_V3 = dict(
    LLAMA32, model_type="deepseek_v3", hidden_size=48, intermediate_size=80,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24,
    q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    first_k_dense_replace=2, rope_scaling=None, tie_word_embeddings=False, eos_token_id=2,
    head_dim=None,
)  # fmt: skip
KINDS = ["full", "sliding", "mla", "recurrent"]


@pytest.fixture(scope="module", params=KINDS)
def model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "full":
        root = chat_llama_folder(root)
    elif request.param == "sliding":
        make_checkpoint(root, MISTRAL_WINDOW)
    elif request.param == "mla":
        deepseek_checkpoint(root, DEEPSEEK_V3)
    else:
        slow_decay(make_checkpoint(root, HYBRID)[0])
    return load_model(root, max_seq_len=SEQ, max_batch_size=ROWS)


class Scripted(Proposer):
    """Drafts the plain greedy answer (`answers`: prompt -> tokens), one drafted token in
    each draft replaced by another at a random place (or none); no draft for prompts it does
    not know."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab: int, seed: int = 0):
        self.answers, self.vocab, self.rng = answers, vocab, random.Random(seed)

    def propose(self, seq, k: int) -> Draft | None:
        ref = self.answers.get(tuple(seq.ids))
        if ref is None:
            return None
        tokens = list(ref[len(seq.out) : len(seq.out) + k])
        at = self.rng.randrange(len(tokens) + 1) if tokens else 0
        if at < len(tokens):
            tokens[at] = (tokens[at] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
        return Draft(tokens)


def speculating(model, proposer: Proposer, k: int = 4, adaptive: bool = False):
    model.speculator = Speculator(SpecConfig(method="ngram", k=k, adaptive=adaptive), proposer)
    return model


def prompts(model, n: int = 2) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    v = model.config.vocab_size
    return [torch.randint(3, v, (10 + 7 * i,), generator=g).tolist() for i in range(n)]


def plain(model, ids, **params) -> list:
    model.speculator = None
    model.reset()
    return model.generate(ids, temperature=0.0, ignore_eos=True, **params)


def test_greedy_tokens_are_plain_decodings(model):
    """Alone and as a batch, drafts accepted and rolled back at every point: the same tokens
    as plain greedy decoding, and drafts were accepted and rejected both."""
    ids = prompts(model)
    want = plain(model, ids, max_new_tokens=40)
    answers = {tuple(x): r.token_ids for x, r in zip(ids, want, strict=True)}
    for k in (1, 5):
        speculating(model, Scripted(answers, model.config.vocab_size, seed=k), k=k)
        model.reset()
        got = model.generate(ids, temperature=0.0, ignore_eos=True, max_new_tokens=40)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        stats = model.speculator.stats
        assert 0 < stats.accepted_tokens < stats.draft_tokens
        alone = model.generate(ids[1], temperature=0.0, ignore_eos=True, max_new_tokens=40)
        assert alone.token_ids == want[1].token_ids


def seq(model, ids, new: int) -> Seq:
    p = SamplingParams.build(model.defaults, max_new_tokens=new, temperature=0.0, ignore_eos=True)
    return Seq(ids, p, set(), None, model.config.vocab_size, model.device)


def test_server_batch_beside_rows_that_draft_nothing(model):
    """Continuous batching as the server runs it (chunked prefill, rows reused, admitted at
    different steps): rows that draft and rows that do not, each its plain answer."""
    ids = prompts(model, 3)
    want = [r.token_ids for r in plain(model, ids, max_new_tokens=24)]
    answers = {tuple(ids[0]): want[0], tuple(ids[2]): want[2]}  # row 1 never drafts
    speculating(model, Scripted(answers, model.config.vocab_size, seed=3), k=3)
    model.reset()
    engine = Engine(model, ROWS, chunk=16, reuse=True, slots=model.slots)
    seqs = [seq(model, x, 24) for x in ids]
    engine.add(seqs[0])
    engine.step()
    engine.add(seqs[1])
    for _ in range(3):
        engine.step()
    engine.add(seqs[2])
    while engine.running:
        engine.step()
    assert [s.out for s in seqs] == want
    assert seqs[1].spec is not None and seqs[1].spec.drafts == 0 and seqs[0].spec.drafts > 0


def test_tensor_parallel_ranks_do_not_time_their_steps(model, monkeypatch):
    """Each rank of a tensor-parallel group runs its own engine (library use): k from its own
    clock would differ between ranks, and so would the shapes of their collectives."""
    speculating(model, Scripted({}, model.config.vocab_size), adaptive=True)
    assert Engine(model, rows=1).spec.timed
    monkeypatch.setattr("core.engine.world_size", lambda: 2)
    assert not Engine(model, rows=1).spec.timed


def test_prompt_lookup_greedy(model):
    """Prompt lookup on a prompt that repeats itself: it drafts, and answers as plain."""
    ids = ([5, 9, 14, 21, 30, 41, 17] * 6)[: SEQ // 4]
    want = plain(model, ids, max_new_tokens=30).token_ids
    model.reset()
    model.speculator = make_speculator(SpecConfig(method="ngram"), model)
    got = model.generate(ids, temperature=0.0, ignore_eos=True, max_new_tokens=30)
    assert got.token_ids == want
    assert got.speculation.drafts > 0
    once = list(range(3, 3 + SEQ // 8))  # no token twice: nothing to look up, nothing drafted
    kw = dict(temperature=0.0, ignore_eos=True, max_new_tokens=3)
    stream = model.stream(once, **kw)
    "".join(stream)
    for result in (model.generate(once, **kw), stream.result):
        assert len(result.token_ids) == 3 and result.speculation is None


def test_seeded_sampling_answers_as_plain(model):
    """A sampling row with a seed takes the tokens it takes without speculation: a one-hot
    draft (the seeded answer, one token spoiled per draft) is taken where the row's own draw
    at that position is it."""
    ids = prompts(model, 1)[0]
    kw = dict(temperature=0.8, seed=3, ignore_eos=True, max_new_tokens=24)
    model.speculator = None
    model.reset()
    want = model.generate(ids, **kw).token_ids
    speculating(model, Scripted({tuple(ids): want}, model.config.vocab_size), k=4)
    model.reset()
    got = model.generate(ids, **kw)
    assert got.token_ids == want
    assert 0 < got.speculation.accepted_tokens < got.speculation.draft_tokens


def test_logprobs_penalties_stops_and_length(model):
    """What a row asks besides greedy tokens behaves as without speculation: the target's
    log-probabilities, penalties, stop tokens, max_new_tokens exactly."""
    ids = prompts(model, 1)[0]
    asks = dict(max_new_tokens=13, logprobs=2, repetition_penalty=1.3, presence_penalty=0.5)
    want = plain(model, ids, **asks)
    base = plain(model, ids, max_new_tokens=13).token_ids
    stop = base[6]
    cut = plain(model, ids, stop_token_ids=[stop], max_new_tokens=13)
    answers = {tuple(ids): want.token_ids}
    speculating(model, Scripted(answers, model.config.vocab_size, seed=5), k=4)
    model.reset()
    got = model.generate(ids, temperature=0.0, ignore_eos=True, **asks)
    assert got.token_ids == want.token_ids and len(got.token_ids) == 13
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert a.top.keys() == b.top.keys()
    model.speculator.proposer.answers = {tuple(ids): base}  # (drafts run on past the stop)
    got = model.generate(ids, temperature=0.0, ignore_eos=True, stop_token_ids=[stop],
                         max_new_tokens=13)  # fmt: skip
    assert got.token_ids == cut.token_ids and got.finish_reason == "stop"
    assert got.speculation.accepted_tokens <= len(got.token_ids) - 1  # (none past the stop)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = chat_llama_folder(tmp_path_factory.mktemp("chat"))
    return load_model(root, max_seq_len=SEQ, max_batch_size=1)


def test_stop_strings_and_grammar(chat):
    """A stop string cuts the text as without speculation; a JSON grammar masks each
    verified position in turn (drafts the grammar bans are rejected)."""
    prompt = "Hello there, tell me"
    want = plain(chat, prompt, max_new_tokens=20)
    stop = want.text[len(want.text) // 2 : len(want.text) // 2 + 2]
    cut = plain(chat, prompt, max_new_tokens=20, stop=[stop])
    ids = tuple(chat.encode_prompt(prompt))
    speculating(chat, Scripted({ids: want.token_ids}, chat.config.vocab_size), k=4)
    chat.reset()
    got = chat.generate(prompt, temperature=0.0, ignore_eos=True, max_new_tokens=20, stop=[stop])
    assert got.text == cut.text and got.token_ids == cut.token_ids and stop not in got.text
    asks = dict(max_new_tokens=16, json_object=True, temperature=0.0)
    chat.speculator, spec = None, chat.speculator
    shaped = chat.generate(prompt, **asks)
    spec.proposer.answers = {ids: shaped.token_ids}
    chat.speculator = spec
    chat.reset()
    got = chat.generate(prompt, **asks)
    assert got.token_ids == shaped.token_ids and got.speculation.drafts > 0
