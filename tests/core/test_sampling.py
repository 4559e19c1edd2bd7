"""core.sampling on a small vocabulary: fixed logits, many seeded draws, written-out formulas."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from core import RequestError, ZooError
from core.sampling import (
    SamplingParams,
    apply_penalties,
    defaults_from_generation_config,
    draw,
    filter_logits,
)

# A fixed distribution over 8 tokens, deliberately not in sorted order.
PROBS = torch.tensor([0.05, 0.25, 0.015, 0.4, 0.1, 0.005, 0.15, 0.03])
LOGITS = PROBS.log() + 3.0  # any shift: softmax must not care
ORDER = sorted(range(8), key=lambda i: -PROBS[i].item())  # [3, 1, 6, 4, 0, 7, 2, 5]
N = 20_000


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, **kw})


def samples(logits: torch.Tensor, n: int = N, seed: int = 0) -> torch.Tensor:
    """n draws from one row of logits, through draw(), from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return draw(logits.expand(n, -1).contiguous(), [g] * n)


def freqs(tokens: torch.Tensor, vocab: int = 8) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / len(tokens)


def entropy(p: torch.Tensor) -> float:
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def kept(logits: torch.Tensor) -> set[int]:
    return {i for i, x in enumerate(logits.tolist()) if math.isfinite(x)}


# --- the draw itself --------------------------------------------------------------------------
def test_draw_samples_from_softmax():
    f = freqs(samples(LOGITS))
    # 20k draws: one standard error is at most sqrt(.25/20000) = 0.0035; allow ~4 of them
    assert (f - PROBS).abs().max() < 0.015


def test_top_k_1_is_greedy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 50, generator=g) * 3
    out = filter_logits(logits, params(top_k=1))
    assert all(len(kept(row)) == 1 for row in out)
    gens = [torch.Generator().manual_seed(i) for i in range(256)]
    for _ in range(5):
        assert torch.equal(draw(out, gens), logits.argmax(dim=-1))
    assert SamplingParams(temperature=0.7, top_k=1).greedy  # and the loop takes argmax for it


@pytest.mark.parametrize("k", [2, 3, 5, 8])
def test_top_k_keeps_the_k_most_likely(k):
    out = filter_logits(LOGITS, params(top_k=k))
    assert kept(out) == set(ORDER[:k])
    assert set(samples(out, 4000).tolist()) == set(ORDER[:k])


def smallest_set_with_mass(p: float) -> set[int]:
    """The definition, written out: most likely first, stop once the mass reaches p."""
    chosen, mass = [], 0.0
    for i in ORDER:
        chosen.append(i)
        mass += PROBS[i].item()
        if mass >= p:
            break
    return set(chosen)


@pytest.mark.parametrize("top_p", [0.05, 0.39, 0.41, 0.6, 0.66, 0.79, 0.81, 0.92, 0.96, 0.999])
def test_top_p_keeps_the_smallest_set_with_mass_p(top_p):
    want = smallest_set_with_mass(top_p)
    out = filter_logits(LOGITS, params(top_p=top_p))
    assert kept(out) == want
    # kept tokens keep their logits; the sample support is exactly that set
    for i in want:
        assert out[i].item() == pytest.approx(LOGITS[i].item())
    f = freqs(samples(out))
    assert set(f.nonzero().flatten().tolist()) == want
    renorm = PROBS * torch.tensor([i in want for i in range(8)])
    assert (f - renorm / renorm.sum()).abs().max() < 0.015


def test_top_p_mass_is_at_least_p_and_minimal():
    for top_p in torch.linspace(0.01, 0.99, 60).tolist():
        keep = torch.isfinite(filter_logits(LOGITS, params(top_p=top_p)))
        mass = PROBS[keep].sum().item()
        smallest = PROBS[keep].min().item()
        assert mass >= top_p - 1e-6  # enough mass
        assert mass - smallest < top_p + 1e-6  # and without its least likely token, not enough


def test_top_p_after_top_k_renormalizes():
    # top-k 3 keeps {.4, .25, .15} (mass .8); renormalized .5, .3125, .1875 -> top_p .6 keeps 2
    out = filter_logits(LOGITS, params(top_k=3, top_p=0.6))
    assert kept(out) == set(ORDER[:2])


@pytest.mark.parametrize(("min_p", "n"), [(0.01, 8), (0.05, 6), (0.3, 3), (0.5, 2), (0.9, 1)])
def test_min_p_keeps_tokens_above_a_fraction_of_the_top(min_p, n):
    # threshold = min_p * 0.4; e.g. 0.3 -> 0.12 keeps .4, .25, .15
    want = {i for i in range(8) if PROBS[i] >= min_p * 0.4}
    assert len(want) == n
    out = filter_logits(LOGITS, params(min_p=min_p))
    assert kept(out) == want
    assert set(samples(out, 4000).tolist()) == want


def test_filter_rows_are_independent():
    batch = torch.stack([LOGITS, LOGITS.flip(0)])
    out = filter_logits(batch, params(top_p=0.6))
    assert kept(out[0]) == set(ORDER[:2])
    assert kept(out[1]) == {7 - i for i in ORDER[:2]}


# --- temperature ------------------------------------------------------------------------------
def test_temperature_scales_logits():
    for t in (0.25, 0.7, 1.0, 3.0):
        out = filter_logits(LOGITS, params(temperature=t))
        assert torch.allclose(out.softmax(-1), (PROBS.log() / t).softmax(-1), atol=1e-6)


def test_temperature_changes_entropy_the_right_way():
    h = {
        t: entropy(freqs(samples(filter_logits(LOGITS, params(temperature=t)))))
        for t in (0.3, 0.6, 1.0, 1.5, 3.0, 1000.0)
    }
    ts = sorted(h)
    assert all(h[a] < h[b] for a, b in itertools.pairwise(ts)), h
    assert h[1.0] == pytest.approx(entropy(PROBS), abs=0.02)
    assert h[1000.0] == pytest.approx(math.log(8), abs=0.01)  # near uniform
    assert h[0.3] < 0.5 * entropy(PROBS)  # sharp


def test_high_temperature_is_near_uniform():
    out = filter_logits(LOGITS, params(temperature=1e4)).softmax(-1)
    assert (out - 1 / 8).abs().max() < 1e-3


# --- penalties --------------------------------------------------------------------------------
def penalized_by_formula(logits, counts, seen, rep, freq, pres):
    """vLLM's order: repetition (transformers' rule) on prompt + output tokens, then OpenAI's
    frequency and presence penalties on output tokens."""
    out = []
    for b in range(len(logits)):
        row = []
        for v in range(len(logits[b])):
            x = logits[b][v]
            if seen[b][v]:
                x = x / rep if x > 0 else x * rep
            x -= freq * counts[b][v]
            x -= pres * (1.0 if counts[b][v] > 0 else 0.0)
            row.append(x)
        out.append(row)
    return torch.tensor(out)


@pytest.mark.parametrize(
    ("rep", "freq", "pres"),
    [(1.3, 0.0, 0.0), (0.8, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 0.7), (1.2, -0.4, 1.1)],
)
def test_penalties_match_the_formula(rep, freq, pres):
    logits = torch.tensor([[2.0, -1.5, 0.0, 3.0, -0.5, 1.0], [1.0, 1.0, -2.0, 0.5, 0.0, -3.0]])
    counts = torch.tensor([[0, 2, 0, 1, 0, 3], [1, 0, 0, 0, 4, 0]], dtype=torch.float32)
    seen = counts > 0
    seen[0, 0] = seen[1, 2] = True  # in the prompt only: repetition penalty, nothing else
    p = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    got = apply_penalties(logits, counts, seen, p)
    want = penalized_by_formula(logits.tolist(), counts.tolist(), seen.tolist(), rep, freq, pres)
    assert torch.allclose(got, want, atol=1e-6)
    # untouched tokens stay exactly as they were
    untouched = ~seen & (counts == 0)
    assert torch.equal(got[untouched], logits[untouched])


def test_repetition_penalty_equals_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g) * 2
    history = torch.randint(0, 40, (3, 12), generator=g)
    seen = torch.zeros(3, 40, dtype=torch.bool).scatter_(1, history, True)
    p = SamplingParams(repetition_penalty=1.25)
    got = apply_penalties(logits, torch.zeros(3, 40), seen, p)
    want = RepetitionPenaltyLogitsProcessor(penalty=1.25)(history, logits.clone())
    assert torch.allclose(got, want, atol=1e-6)


def test_penalties_off_change_nothing():
    logits = torch.randn(2, 10)
    counts = torch.ones(2, 10)
    out = apply_penalties(logits, counts, counts > 0, SamplingParams())
    assert torch.equal(out, logits)


# --- seeds ------------------------------------------------------------------------------------
def test_same_seed_same_draws_different_seed_different():
    logits = torch.zeros(1, 50)  # uniform: every draw is a real coin flip

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [draw(logits, [g]).item() for _ in range(40)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_each_row_has_its_own_generator():
    logits = torch.zeros(3, 50)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 1)]
    rows = torch.stack([draw(logits, gens) for _ in range(30)], dim=1)  # (3, 30)
    assert torch.equal(rows[0], rows[2])  # same seed -> same stream, whatever its row
    assert not torch.equal(rows[0], rows[1])
    alone = draw(logits[:1], [torch.Generator().manual_seed(1)])  # a row of one, same seed
    assert alone.item() == rows[0, 0].item()


# --- parameters -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"temprature": 0.5}, "temprature"),
        ({"seed": "abc"}, "seed"),
        ({"seed": 2**64}, "seed"),  # beyond what torch.Generator takes
    ],
)
def test_bad_parameters_raise_request_error_naming_them(kw, name):
    with pytest.raises(RequestError) as exc:
        SamplingParams.build({}, **kw)
    assert isinstance(exc.value, ZooError)
    assert f"'{name}'" in str(exc.value)


def test_unknown_parameter_is_called_unknown():
    with pytest.raises(RequestError, match="unknown parameter 'do_sampel'"):
        SamplingParams.build({}, do_sampel=True)


def test_good_parameters_and_stop_forms():
    p = SamplingParams.build({}, stop="###", stop_token_ids=[5, 6], top_p=1.0, logprobs=0)
    assert p.stop == ("###",) and p.stop_token_ids == (5, 6) and p.logprobs == 0
    assert SamplingParams.build({}, stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


# --- generation_config.json defaults ----------------------------------------------------------
@pytest.mark.parametrize(
    ("gen", "want"),
    [
        # meta-llama/Llama-3.1-8B-Instruct
        (
            {
                "bos_token_id": 128000,
                "do_sample": True,
                "eos_token_id": [128001, 128008, 128009],
                "temperature": 0.6,
                "top_p": 0.9,
                "transformers_version": "4.42.3",
            },
            {"temperature": 0.6, "top_p": 0.9},
        ),
        # Qwen/Qwen2.5-7B-Instruct
        (
            {
                "bos_token_id": 151643,
                "pad_token_id": 151643,
                "do_sample": True,
                "eos_token_id": [151645, 151643],
                "repetition_penalty": 1.05,
                "temperature": 0.7,
                "top_p": 0.8,
                "top_k": 20,
                "transformers_version": "4.37.0",
            },
            {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
        ),
        ({"do_sample": False, "temperature": 0.6, "top_p": 0.9}, {"temperature": 0.0}),
        ({"do_sample": True}, {"temperature": 1.0}),  # transformers' default temperature
        ({"do_sample": True, "min_p": 0.1, "max_new_tokens": 77}, {"temperature": 1.0}),
        ({"bos_token_id": 1, "eos_token_id": 2}, {}),
        ({}, {}),
    ],
)
def test_defaults_from_generation_config(gen, want):
    got = defaults_from_generation_config(gen)
    extra = {k: gen[k] for k in ("min_p", "max_new_tokens") if k in gen}
    assert got == {**want, **extra}
    SamplingParams.build(got)  # every default it produces is valid


def test_request_overrides_defaults():
    defaults = defaults_from_generation_config({"do_sample": True, "temperature": 0.6, "top_k": 5})
    p = SamplingParams.build(defaults, temperature=0.0)
    assert p.temperature == 0.0 and p.top_k == 5 and p.greedy
    assert SamplingParams.build(defaults).temperature == 0.6
