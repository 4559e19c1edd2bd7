"""The parity checks every architecture passes against its transformers reference (fp32).

Each takes a loaded Zoo model and the transformers model the checkpoint was saved from.
"""

from __future__ import annotations

from typing import ClassVar

import torch

TOL = 1e-4  # max |error| / max |reference logit|, fp32


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def ids(vocab: int, b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def check_prefill(m, ref, x: torch.Tensor) -> None:
    m.reset()
    assert rel_err(m.forward(x), ref(x).logits) < TOL


@torch.no_grad()
def check_decode(m, ref, x: torch.Tensor, prefill: int) -> None:
    """Prefill `prefill` tokens, then one token at a time against the full-sequence logits."""
    m.reset()
    want = ref(x).logits
    got = [m.forward(x[:, :prefill], 0)]
    for t in range(prefill, x.shape[1]):
        got.append(m.forward(x[:, t : t + 1], t))
    assert rel_err(torch.cat(got, dim=1), want) < TOL


@torch.no_grad()
def check_greedy(m, ref, prompt: torch.Tensor, n: int = 12) -> None:
    t = prompt.shape[1]
    want = ref.generate(
        prompt, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    m.reset()
    m.eos_token_ids = set()  # transformers was told not to stop; ours must not either
    got = m.generate(prompt[0].tolist(), max_new_tokens=n)
    assert got.token_ids == want[0, t:].tolist()
    assert len(got.token_ids) == n


@torch.no_grad()
def check_batch_of_two(m, x: torch.Tensor, ref=None) -> None:
    """Rows of a batch equal each row alone, in prefill and in a decode step; given the
    reference, each row alone also equals the reference on that row."""
    m.reset()
    both = m.forward(x)
    for row in range(2):
        m.reset()
        alone = m.forward(x[row : row + 1])
        assert rel_err(both[row : row + 1], alone) < 1e-5
        if ref is not None:
            assert rel_err(alone, ref(x[row : row + 1]).logits) < TOL
    m.reset()
    m.forward(x[:, :-1])
    t = x.shape[1] - 1
    assert rel_err(m.forward(x[:, t:], t), both[:, t:]) < TOL


@torch.no_grad()
def check_ragged_batch(m, ref, vocab: int, lengths=(5, 9), steps: int = 3, new: int = 4) -> None:
    """Prompts of unequal length in one batch: a right-padded prefill, then decode steps at
    per-row positions; each row's logits equal the reference run on that row alone. Then the
    same prompts as one batch of greedy generation (the token loop's decode step, which reads
    the cache up to a bucket): each row's tokens and logprobs are the reference's for it."""
    rows = [ids(vocab, 1, n + steps, seed=10 + i)[0] for i, n in enumerate(lengths)]
    batch = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    for r, n in enumerate(lengths):
        batch[r, :n] = rows[r][:n]
    m.reset()
    # padding sits after each prompt; causality keeps it unseen, and `lengths` keeps it out of
    # sliding layers' ring buffers
    prefill = m.forward(batch, lengths=lengths)
    got = [[prefill[r, :n]] for r, n in enumerate(lengths)]
    for s in range(steps):
        pos = torch.tensor(lengths) + s  # each row at its own position
        nxt = torch.stack([row[n + s] for row, n in zip(rows, lengths, strict=True)])
        step = m.forward(nxt[:, None], pos)
        for r in range(len(rows)):
            got[r].append(step[r])
    for r in range(len(rows)):
        want = ref(rows[r][None]).logits[0]
        assert rel_err(torch.cat(got[r]), want) < TOL

    prompts = [row[:n].tolist() for row, n in zip(rows, lengths, strict=True)]
    m.reset()
    greedy = dict(max_new_tokens=new, temperature=0.0, ignore_eos=True, logprobs=1)
    check_generated(ref, prompts, m.generate(prompts, **greedy))


@torch.no_grad()
def check_generated(ref, prompts: list[list[int]], results) -> None:
    """Greedy results against the reference run on each prompt and its new tokens alone: every
    token is the reference's argmax there (so transformers' greedy tokens), and its logprob
    is the reference's within the logit bar (log_softmax moves by at most 2x the logit error)."""
    for prompt, res in zip(prompts, results, strict=True):
        seq = torch.tensor([prompt + res.token_ids])
        logits = ref(seq).logits[0, len(prompt) - 1 : -1].float()  # each new token's logits
        assert res.token_ids == logits.argmax(-1).tolist()
        want = logits.log_softmax(-1).gather(-1, torch.tensor(res.token_ids)[:, None])[:, 0]
        got = torch.tensor([lp.logprob for lp in res.logprobs])
        assert (got - want).abs().max() <= 2 * TOL * logits.abs().max(), (got, want)


class ParitySuite:
    """The five checks above as tests: a module subclasses it (`class TestParity(ParitySuite)`),
    sets `vocab` and the sizes that differ, and gives a `model` fixture returning (Zoo model,
    transformers reference, ...). The names are what tests/kernels/test_end_to_end.py selects
    to run each suite through the Triton kernels."""

    vocab: int
    prefill_len = 20  # tokens of the batch-of-two prefill
    decode = (16, 10)  # (sequence, prefill): decoded one token at a time after the prefill
    greedy_len, greedy_new = 7, 12  # prompt tokens, generated tokens
    ragged: ClassVar[dict] = {}  # check_ragged_batch's lengths / steps / new

    def test_prefill_logits_match(self, model):
        m, ref = model[:2]
        check_prefill(m, ref, ids(self.vocab, 2, self.prefill_len))

    def test_decode_steps_match_full_sequence(self, model):
        m, ref = model[:2]
        check_decode(m, ref, ids(self.vocab, 1, self.decode[0]), prefill=self.decode[1])

    def test_greedy_tokens_identical(self, model):
        m, ref = model[:2]
        check_greedy(m, ref, ids(self.vocab, 1, self.greedy_len, seed=3), n=self.greedy_new)

    def test_batch_of_two_equals_each_alone(self, model):
        m, ref = model[:2]
        check_batch_of_two(m, ids(self.vocab, 2, 13), ref)

    def test_ragged_batch_at_per_row_positions(self, model):
        m, ref = model[:2]
        check_ragged_batch(m, ref, self.vocab, **self.ragged)
