"""Shared fixtures: tiny random checkpoints made by transformers, saved with hub-style keys."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

# Triton decorates its own @jit helpers when it is first imported (torch.compile imports it),
# so the CPU interpreter the kernel tests use must be chosen before any test can import it.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# what Zoo remembers per machine (the CPU split verdict, compiled C kernels) goes to a folder of
# the test session's, never read from or written to the user's ~/.cache/zoo. One folder for the
# whole session: pytest-xdist's workers and the pytest run test_end_to_end starts inherit it, so
# the C library is compiled once, not once per process (its builds are atomic), and every
# process reads one split verdict, as the processes of a user's machine do
if "ZOO_TEST_CACHE" not in os.environ:
    os.environ["ZOO_TEST_CACHE"] = tempfile.mkdtemp(prefix="zoo-test-cache-")
os.environ["ZOO_CACHE"] = os.environ["ZOO_TEST_CACHE"]

# The longest test files run first: `make test` hands files to its worker processes in this
# order (pytest-xdist --dist loadfile), so one that takes minutes starts while the other
# workers take the rest, instead of running alone at the end.
FIRST = ("tests/kernels/test_end_to_end.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in FIRST)  # stable: the rest as is


# A Llama 3.2-style tiny model: GQA (4 q heads / 2 kv heads), explicit head_dim != hidden/heads,
# llama3 rope scaling, tied embeddings.
LLAMA32 = dict(
    model_type="llama",
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    ),
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=[2, 3],
    torch_dtype="bfloat16",
)
# A Llama 3.1-style tiny model: untied head, plain rope scaling kinds chosen per test.
LLAMA31 = dict(
    LLAMA32,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=None,
    tie_word_embeddings=False,
    rope_scaling=None,
    rope_theta=10000.0,
    eos_token_id=2,
)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Scale weights up from the tiny init so that a wrong op changes the logits visibly."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)


def hub_style(cfg: dict, *, rope_key: str = "rope_type") -> dict:
    """Rewrite a saved config.json the way real hub repos spell it (transformers 4 style)."""
    cfg = dict(cfg)
    params = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type")}
    kind = params.get("rope_type", "default")
    cfg["rope_scaling"] = None if kind == "default" else {rope_key: kind, **scaling}
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


def make_checkpoint(
    root: Path, spec: dict, *, seed: int = 0, rope_key: str = "rope_type", raw: bool = False
):
    """Build a transformers model from `spec`, save it under root, rewrite config.json.

    Returns (folder, the transformers model in fp32 eval mode) for reference runs.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    drop = [k for k, v in spec.items() if v is None]  # keys a hub config would not carry
    spec = {k: v for k, v in spec.items() if v is not None}
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, seed)
    model.save_pretrained(root, safe_serialization=True)
    if not raw:
        cfg_path = root / "config.json"
        cfg = hub_style(json.loads(cfg_path.read_text()), rope_key=rope_key)
        cfg = {k: v for k, v in cfg.items() if k not in drop}
        cfg_path.write_text(json.dumps(cfg, indent=1))
    return root, model


def save_in_memory_names(root: Path, ref, drop: tuple[str, ...] = ()) -> dict:
    """Rewrite root's model.safetensors with the transformers model's in-memory state dict
    (transformers 5 holds routed experts stacked, `mlp.experts.gate_up_proj` / `down_proj`,
    where save_pretrained writes the hub's per-expert names), less `drop`; returns it."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in ref.state_dict().items() if k not in drop}
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    return state


def chat_llama_folder(root: Path) -> Path:
    """A tiny Llama 3.2 with a Llama 3 chat tokenizer in `root` (its vocabulary of 320 covers
    the tokenizer's ids) and an empty generation_config.json: what the server and `zoo --tp`
    tests serve."""
    from fixtures.chat_tokenizers import build_tokenizer_folder

    special = build_tokenizer_folder(root, "llama3")
    spec = dict(
        LLAMA32,
        vocab_size=320,
        max_position_embeddings=256,
        bos_token_id=special["<|begin_of_text|>"],
        eos_token_id=special["<|eot_id|>"],
    )
    make_checkpoint(root, spec, seed=2)
    (root / "generation_config.json").write_text("{}")
    return root


@pytest.fixture(scope="module")
def drafts_k_max():
    """Every sequence drafts k tokens a step (adaptive k follows the steps' timing, which on
    a busy machine may stop drafting for a while): what is counted does not vary by run."""
    from core.speculative import AdaptiveK

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AdaptiveK, "next", lambda self: self.k_max)
        yield


@pytest.fixture
def checkpoint(tmp_path):
    """Factory fixture: checkpoint(spec, **kw) -> (folder, reference model)."""
    n = iter(range(1000))

    def make(spec: dict, **kw):
        return make_checkpoint(tmp_path / f"ckpt{next(n)}", spec, **kw)

    return make
