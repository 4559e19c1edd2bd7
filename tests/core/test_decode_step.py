"""The decode step: buckets, prefill logits_at, and the compiled step against transformers."""

from __future__ import annotations

import pytest
import torch
from conftest import LLAMA31, LLAMA32

from core import load_model
from core.decode_step import bucket
from core.errors import ConfigError

TOL = 1e-4


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def ids(vocab: int, b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def test_bucket_is_a_power_of_two_at_least_256_within_the_cache():
    assert bucket(1, 4096) == 256 and bucket(256, 4096) == 256
    assert bucket(257, 4096) == 512 and bucket(1025, 4096) == 2048
    assert bucket(3000, 3000) == 3000 and bucket(10, 100) == 100


def test_logits_at_equals_those_rows_of_the_full_logits(checkpoint):
    root, ref = checkpoint(LLAMA31)
    m = load_model(root, max_batch_size=2)
    x = ids(LLAMA31["vocab_size"], 2, 9)
    full = m.forward(x)
    m.reset()
    at = torch.tensor([8, 3])
    with torch.inference_mode():
        some = m.net(x, 0, logits_at=at)
    assert some.shape == (2, 1, LLAMA31["vocab_size"])
    torch.testing.assert_close(some[:, 0], full[torch.arange(2), at], rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        want = ref(x).logits[torch.arange(2), at]  # transformers' logits at those positions
    assert rel_err(some[:, 0], want) < TOL


def test_a_cpu_model_runs_the_split_probe_when_loaded(checkpoint, monkeypatch):
    """The CPU linear's probe is timed at load, eagerly: not in a request, not in a trace."""
    import kernels.cpu

    asked = []
    monkeypatch.setattr(kernels.cpu, "split_pays", lambda dtype: asked.append(dtype) or False)
    root, _ = checkpoint(LLAMA31)
    load_model(root)
    assert asked == [torch.float32]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Tiny Llama 3.2, cache long enough for two buckets, decode step compiled (slow: once)."""
    from conftest import make_checkpoint

    spec = dict(LLAMA32, max_position_embeddings=512)
    root, ref = make_checkpoint(tmp_path_factory.mktemp("ckpt"), spec)
    return load_model(root, max_seq_len=300, max_batch_size=2, compile=True), ref


@torch.no_grad()
def test_compiled_steps_match_transformers_across_a_bucket(compiled):
    """Prefill 250 tokens, then compiled one-token steps over positions 250..265 (buckets
    256 and 300): every step's logits equal transformers' full-sequence logits."""
    m, ref = compiled
    x = ids(LLAMA32["vocab_size"], 1, 266, seed=3)
    want = ref(x).logits[0, 250:]
    m.reset()
    m.forward(x[:, :250])
    got = []
    with torch.inference_mode():
        for t in range(250, 266):
            got.append(m.step(x[:, t], torch.tensor([t]), t + 1)[0])
    assert m.step.compiled is not None
    assert rel_err(torch.stack(got), want) < TOL


@torch.no_grad()
def test_compiled_greedy_batch_matches_transformers(compiled):
    """A ragged batch of two generates, compiled, the tokens transformers generates for each."""
    m, ref = compiled
    m.eos_token_ids = set()
    prompts = [ids(LLAMA32["vocab_size"], 1, n, seed=n)[0].tolist() for n in (7, 12)]
    got = m.generate(prompts, max_new_tokens=10, ignore_eos=True)
    for prompt, res in zip(prompts, got, strict=True):
        x = torch.tensor([prompt])
        kw = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        want = ref.generate(x, **kw)
        assert res.token_ids == want[0, len(prompt) :].tolist()


def test_a_compiled_step_is_one_graph_even_as_the_first_call(checkpoint, monkeypatch):
    """Nothing in the step breaks the graph, also when it is traced before any eager call
    (the kernel dispatch's first choices, with their log line and imports, are made when the
    step is built): a break costs a guard check and an eager fallback per layer (~15 ms a
    token on SmolLM2)."""
    from torch._dynamo.utils import counters

    import kernels.dispatch

    monkeypatch.setattr(kernels.dispatch, "_chosen", {})
    monkeypatch.setattr(kernels.dispatch, "_logged", set())
    root, _ = checkpoint(LLAMA31)
    m = load_model(root, compile=True)
    counters.clear()
    with torch.inference_mode():
        m.step(torch.tensor([5]), torch.tensor([0]), 1)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1


def test_compile_refuses_dynamic_ntk_rope(checkpoint):
    root, _ = checkpoint(dict(LLAMA31, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ConfigError, match="dynamic NTK"):
        load_model(root, compile=True)
