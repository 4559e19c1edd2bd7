"""load_model's options and Model's request checks."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import LLAMA31
from fixtures.replay import replay

from core import CheckpointError, HubError, RequestError, ZooError, load_model


@pytest.fixture
def root(checkpoint):
    return checkpoint(LLAMA31)[0]


def test_defaults_on_cpu(root, caplog):
    with caplog.at_level(logging.INFO, logger="zoo"):
        m = load_model(root)
    assert m.device.type == "cpu" and m.dtype == torch.float32  # fp32 on the CPU
    # max_seq_len = min(max_position_embeddings, 4096); per layer k, v (B, kv_heads, S, head_dim)
    assert m.max_seq_len == 128 and m.max_batch_size == 1
    assert len(m.net.kv_cache.layers) == 2
    assert [tuple(t.shape) for t in m.net.kv_cache.layer(1)] == [(1, 1, 128, 16)] * 2
    assert "KV cache 1 x 128 tokens" in caplog.text


def test_cache_size_options(root):
    m = load_model(root, max_seq_len=20, max_batch_size=3)
    assert [tuple(t.shape) for t in m.net.kv_cache.layer(0)] == [(3, 1, 20, 16)] * 2


def test_missing_path_is_a_zoo_error(tmp_path):
    with pytest.raises(HubError, match="not a local folder"):
        load_model(tmp_path / "nope")


def test_prompt_beyond_cache_is_refused_before_compute(root):
    m = load_model(root, max_seq_len=10)
    with pytest.raises(RequestError) as exc:
        m.generate(list(range(4, 12)), max_new_tokens=5)
    msg = str(exc.value)
    assert "8 tokens" in msg and "13" in msg and "max_seq_len=10" in msg


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"prompt": []}, "empty"),
        ({"prompt": [5, 96, -1]}, r"\[96, -1\] outside the vocabulary \[0, 96\)"),
        ({"prompt": [5], "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": [5], "temperature": -1.0}, "temperature"),
    ],
)
def test_bad_generate_arguments(root, kwargs, word):
    with pytest.raises(RequestError, match=word):
        load_model(root).generate(**kwargs)


def test_forward_checks_batch_and_length(root):
    m = load_model(root, max_seq_len=8)
    with pytest.raises(RequestError, match="max_batch_size=1"):
        m.forward(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(RequestError, match="max_seq_len=8"):
        m.forward(torch.zeros(1, 9, dtype=torch.long))


def test_bad_dtype_name(root):
    with pytest.raises(RequestError, match="'float8'"):
        load_model(root, dtype="float8")


def test_seeded_sampling_draws_what_the_seed_promises(checkpoint):
    """A seed fixes the draws: transformers' logits and a generator of that seed give the same
    tokens (fixtures.replay), on every call; another seed gives others."""
    root, ref = checkpoint(LLAMA31)
    m = load_model(root)
    kw = dict(max_new_tokens=6, temperature=1.0, ignore_eos=True)
    for seed in (11, 12):
        want = replay(ref, [5, 6, 7], seed=seed, **kw)
        assert m.generate([5, 6, 7], seed=seed, **kw).token_ids == want
        assert m.generate([5, 6, 7], seed=seed, **kw).token_ids == want
    assert replay(ref, [5, 6, 7], seed=11, **kw) != replay(ref, [5, 6, 7], seed=12, **kw)


def test_every_error_is_a_zoo_error():
    import core

    for name in ("ConfigError", "CheckpointError", "PluginError", "RequestError", "HubError"):
        assert issubclass(getattr(core, name), ZooError)


def test_a_kernel_refusal_reaches_the_user_as_a_zoo_error(root, monkeypatch):
    """kernels import nothing from core: their KernelError becomes a ZooError (same message,
    still a kernels.KernelError) at Model's calls."""
    import kernels

    m = load_model(root)
    monkeypatch.setenv("ZOO_KERNELS", "bogus")
    want = "ZOO_KERNELS='bogus' is not one of auto, triton, torch"
    for call in (
        lambda: m.forward(torch.tensor([[5, 6]])),
        lambda: m.generate([5, 6, 7], max_new_tokens=2),
        lambda: "".join(m.stream([5, 6, 7], max_new_tokens=2)),
    ):
        with pytest.raises(ZooError, match=want) as exc:
            call()
        assert isinstance(exc.value, kernels.KernelError)


def test_cache_that_cannot_fit_is_refused_up_front(root):
    with pytest.raises(RequestError) as exc:
        load_model(root, max_seq_len=10**9, max_batch_size=64)
    msg = str(exc.value)
    # 64 rows x 1e9 tokens x 256 bytes per token (2 K/V x 2 layers x 1 kv head x 16 dims x fp32)
    assert f"{64 * 10**9 * 256:,} bytes" in msg and "max_seq_len" in msg


def test_nonfinite_weights_are_an_opt_in_check(root):
    from safetensors.torch import load_file, save_file

    f = root / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.1.mlp.down_proj.weight"][3, 4] = float("nan")
    save_file(tensors, f, metadata={"format": "pt"})
    load_model(root)  # off by default: loading stays one pass over the file
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) hold NaN or Inf.*down_proj"):
        load_model(root, check_finite=True)
