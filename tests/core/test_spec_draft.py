"""Speculative decoding with a draft model (core/spec_draft.py) on tiny checkpoints: greedy
output token for token that of plain decoding; each draft the draft model's own greedy
continuation (its cache rows kept in step, rings and recurrent states rolled back); a draft of
another tokenizer refused by name; sampled drafts drawn from the row's filtered distribution."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import LLAMA32, make_checkpoint
from fixtures.chat_tokenizers import build_tokenizer_folder
from fixtures.recurrent import HYBRID, slow_decay
from safetensors.torch import load_file, save_file

from core import ConfigError, load_model
from core.errors import ZooError
from core.sampling import SamplingParams, filter_logits
from core.spec_draft import DraftProposer
from core.speculative import Draft

PROMPTS = [[5, 17, 42, 8, 99, 23, 61, 7, 30, 12, 44], [9, 3, 71]]  # different lengths
NEW = 20
SLIDING = dict(LLAMA32, model_type="mistral", vocab_size=128, sliding_window=4, rope_scaling=None)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: a second thread only adds synchronization
    yield
    torch.set_num_threads(n)


def perturbed(src, dst, scale: float, seed: int):
    """A copy of checkpoint folder src with noise added to every weight: a draft that agrees
    with src often, not always."""
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    path = dst / "model.safetensors"
    weights = load_file(path)
    noisy = {
        n: t + scale * torch.randn(t.shape, generator=g).to(t.dtype) for n, t in weights.items()
    }
    save_file(noisy, path, metadata={"format": "pt"})
    return dst


def widened(src, dst, vocab: int):
    """A copy of checkpoint folder src with `vocab` ids: rows past src's with large weights,
    which would win the argmax often where they were not masked."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    path, old = dst / "model.safetensors", config["vocab_size"]
    weights = load_file(path)
    for name, t in weights.items():
        if t.shape[0] == old:  # the embedding (tied) or the LM head
            weights[name] = torch.cat([t, 2 * torch.randn(vocab - old, *t.shape[1:])])
    save_file(weights, path, metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
    return dst


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(target folder, draft folder): tiny Llamas with a Llama 3 tokenizer, the draft a noisy
    copy of the target."""
    root = tmp_path_factory.mktemp("target")
    special = build_tokenizer_folder(root, "llama3")
    spec = dict(LLAMA32, vocab_size=320, bos_token_id=special["<|begin_of_text|>"],
                eos_token_id=special["<|end_of_text|>"])  # fmt: skip
    target = make_checkpoint(root, spec, seed=2)[0]
    return target, perturbed(target, root.parent / "draft", 0.01, seed=1)


def speculative(target, draft, k: int = 4):
    return load_model(target, max_batch_size=2, max_seq_len=64,
                      speculative={"method": "draft", "draft": str(draft), "k": k})  # fmt: skip


def generate(model, prompts, plain: bool = False, **kw):
    """Token ids of each prompt's continuation (plain: without the model's speculation)."""
    spec, model.speculator = model.speculator, None if plain else model.speculator
    try:
        out = model.generate(prompts, max_new_tokens=NEW, ignore_eos=True, **kw)
    finally:
        model.speculator = spec
    return [r.token_ids for r in out]


def recorded(model) -> list[tuple[list[int], Draft]]:
    """(context, Draft) of every draft the model's proposer makes from now."""
    proposer, calls = model.speculator.proposer, []
    propose = proposer.propose

    def record(seq, k):
        draft = propose(seq, k)
        calls.append((seq.ids + seq.out, draft))
        return draft

    proposer.propose = record
    return calls


@pytest.mark.parametrize("draft_is", ["itself", "noisy"])
def test_greedy_is_plain_decoding(llama, draft_is):
    """A draft of the target's own weights is always accepted; a noisy one sometimes; the
    tokens are plain decoding's either way, for a batch of two prompts of unequal length."""
    target, noisy = llama
    model = speculative(target, target if draft_is == "itself" else noisy)
    want = generate(model, PROMPTS, plain=True)
    assert generate(model, PROMPTS) == want
    rate = model.speculator.stats.acceptance_rate
    assert rate == 1.0 if draft_is == "itself" else 0 < rate < 1, model.speculator.stats


@pytest.mark.parametrize("kind", ["full", "sliding", "recurrent"])
def test_drafts_are_the_drafts_own_greedy_tokens(tmp_path, llama, kind):
    """Each draft is what the draft model alone continues the sequence with: its cache row
    holds exactly the sequence's tokens after every verify, rejected drafts undone (a ring's
    slots put back, a recurrent state rewound and refed), over several rejections."""
    if kind == "full":
        target, draft = llama
    else:
        spec = SLIDING if kind == "sliding" else dict(HYBRID, vocab_size=128)
        target = make_checkpoint(tmp_path / "target", spec, seed=3)[0]
        if kind == "recurrent":  # a state that remembers: a wrong one shows
            slow_decay(target)
        draft = perturbed(target, tmp_path / "draft", 0.01, seed=4)
    model = speculative(target, draft, k=3)
    calls = recorded(model)
    # then prompts sharing a prefix with what the rows hold: a wrapped ring or a recurrent
    # state cannot resume from it, full attention can
    for prompts in (PROMPTS, [[*PROMPTS[0][:6], 77, 78], [*PROMPTS[1], 5]]):
        assert generate(model, prompts) == generate(model, prompts, plain=True)
    stats = model.speculator.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # rows rolled back, more than once
    alone = load_model(draft, max_seq_len=64, prefix_cache=False)
    for context, d in calls:
        want = alone.generate(context, max_new_tokens=len(d.tokens), ignore_eos=True)
        assert d.tokens == want.token_ids and d.probs is None, context


def test_sampled_drafts_follow_the_rows_sampler(tmp_path, llama):
    """A sampling row's drafts come with the distribution they were drawn from, filtered as
    the row's sampler filters the target's, over the target's ids: a self-draft with ids
    the target lacks (masked) then matches the target and is nearly always accepted."""
    target, _ = llama
    model = speculative(target, widened(target, tmp_path / "wide", 384))
    calls = recorded(model)
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=3)
    out = generate(
        model, PROMPTS, **p.model_dump(include={"temperature", "top_k", "top_p", "seed"})
    )
    assert [len(x) for x in out] == [NEW, NEW]
    assert all(0 <= t < 320 for x in out for t in x)
    assert model.speculator.stats.acceptance_rate > 0.9
    for context, d in calls[:4]:  # q: the target's filtered softmax at each drafted position
        ids = torch.tensor([context + d.tokens[:-1]])
        logits = model.forward(ids)[0, len(context) - 1 :].float()
        want = filter_logits(logits, p).softmax(dim=-1)
        assert d.probs.shape == want.shape
        torch.testing.assert_close(d.probs, want, atol=1e-5, rtol=1e-4)
        assert all(d.probs[i, t] > 0 for i, t in enumerate(d.tokens))


def test_refused_drafts(tmp_path, llama):
    """Another tokenizer, the target itself, a cache too small, a draft not found, each named."""
    target, _ = llama
    other = tmp_path / "other"
    build_tokenizer_folder(other, "qwen2")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(target / name, other / name)
    with pytest.raises(
        ConfigError, match=f"draft model {other} does not share the tokenizer of {target}"
    ):
        speculative(target, other)
    model = load_model(target, max_batch_size=2, max_seq_len=64)
    load = dict(device=model.device, dtype=model.dtype, max_seq_len=64, max_batch_size=2)
    with pytest.raises(ConfigError, match="is the target model itself"):
        DraftProposer.load(model, model, **load)
    small = load_model(target, max_seq_len=32)
    with pytest.raises(ConfigError, match=r"1 rows x 32 tokens, less than the target's 2 x 64"):
        DraftProposer.load(small, model, **load)
    with pytest.raises(ZooError, match=f"^the draft model: '{tmp_path}/none' is not a local"):
        DraftProposer.load(str(tmp_path / "none"), model, **load)
