"""The tiny parity models run through the Triton kernels (ZOO_KERNELS=triton; on the CPU also
TRITON_INTERPRET=1, which kernel_harness sets) and still match transformers (fp32 logits within
1e-4 of max |logit|, greedy tokens identical).

- In process: every upper-case spec dict with a "model_type" in tests/conftest.py (today the
  Llama 3.2 and 3.1 specs), through prefill, decode steps and greedy generation.
- Every architecture: the plugin parity suites (tests/plugins/test_*.py: Llama, Qwen2,
  DeepSeek, and any added later) re-run in a subprocess with ZOO_KERNELS=triton on the CPU
  interpreter, keeping their prefill and decode checks. A new architecture joins by naming
  its parity tests `test_prefill_logits_match` / `test_decode_steps_match_full_sequence`, as
  the others do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import conftest
import pytest
import torch
from kernel_harness import DEVICE, gpu

from core import load_model
from kernels import dispatch

SPECS = {
    name.lower(): spec
    for name, spec in vars(conftest).items()
    if name.isupper() and isinstance(spec, dict) and "model_type" in spec
}
BAR = 1e-4  # fp32: max |error| / max |logit|, the parity tests' bar
STEPS = 4  # decode steps, and greedy tokens, through the decode kernel
ROOT = Path(__file__).resolve().parents[2]
PARITY = "prefill_logits_match or decode_steps_match"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float().cpu() - want.float()).abs().max() / want.float().abs().max()).item()


def ids(spec: dict, b: int, t: int) -> torch.Tensor:
    return torch.randint(4, spec["vocab_size"], (b, t), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def triton_kernels(monkeypatch):
    monkeypatch.setenv("ZOO_KERNELS", "triton")
    monkeypatch.setattr(dispatch, "_chosen", {})


@pytest.mark.parametrize("name", sorted(SPECS))
@torch.no_grad()
def test_tiny_model_through_triton_matches_transformers(checkpoint, triton_kernels, name):
    spec = SPECS[name]
    root, ref = checkpoint(spec)
    m = load_model(root, device=DEVICE, dtype="float32", max_batch_size=2, max_seq_len=32)
    x = ids(spec, 2, 11)

    # prefill (batch 2, T = 11), then decode steps against the full-sequence reference
    got = m.forward(x)
    assert rel_err(got, ref(x).logits) < BAR
    seq = x
    for step in range(STEPS):
        nxt = got[:, -1:].argmax(-1).cpu()
        seq = torch.cat([seq, nxt], dim=1)
        got = m.forward(nxt, seq.shape[1] - 1)
        assert rel_err(got[:, -1], ref(seq).logits[:, -1]) < BAR, f"decode step {step}"

    # greedy generation: identical tokens (eos disabled on both sides)
    want = ref.generate(
        x[:1], max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    m.reset()
    m.eos_token_ids = set()
    assert m.generate(x[0].tolist(), max_new_tokens=STEPS).token_ids == want[0, 11:].tolist()

    # every op went through Triton: forced mode raises rather than falling back
    assert {key[0] for key in dispatch._chosen} >= {"rms_norm", "apply_rope", "attention"}


@pytest.mark.slow
def test_every_parity_model_through_triton():
    # on the CPU interpreter even where a GPU is present: the parity suites expect CPU fp32
    # (on CUDA they would load the checkpoints' bf16); the in-process test covers the GPU
    env = dict(os.environ, ZOO_KERNELS="triton", TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/plugins"]
    run = subprocess.run(
        [*cmd, "-k", PARITY], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


@gpu
@torch.no_grad()
def test_compiled_decode_on_cuda_matches_transformers(checkpoint):
    """GPU: the decode step compiled with mode="reduce-overhead" (CUDA graphs) over the Triton
    kernels gives the greedy tokens transformers gives, for one row and a ragged batch."""
    root, ref = checkpoint(conftest.LLAMA32)
    ref = ref.to("cuda")
    m = load_model(root, device="cuda", dtype="float32", max_batch_size=2, compile=True)
    m.eos_token_ids = set()
    vocab = conftest.LLAMA32["vocab_size"]
    prompts = [torch.randint(4, vocab, (n,)).tolist() for n in (9, 14)]
    kw = dict(max_new_tokens=STEPS * 3, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = [ref.generate(torch.tensor([p], device="cuda"), **kw)[0, len(p) :].tolist()
            for p in prompts]  # fmt: skip
    alone = m.generate(prompts[0], max_new_tokens=STEPS * 3, ignore_eos=True)
    batch = m.generate(prompts, max_new_tokens=STEPS * 3, ignore_eos=True)
    assert alone.token_ids == want[0]
    assert [r.token_ids for r in batch] == want
