"""The tiny parity models run through the Triton kernels (ZOO_KERNELS=triton; on the CPU also
TRITON_INTERPRET=1, which kernel_harness sets) and still match transformers (fp32 logits within
1e-4 of max |logit|, greedy tokens identical).

- In process: every upper-case spec dict with a "model_type" in tests/conftest.py (today the
  Llama 3.2 and 3.1 specs), through prefill, decode steps, greedy generation and greedy
  generation of a ragged batch.
- Every architecture: the plugin parity suites (tests/plugins/test_*.py: Llama, Qwen2, Qwen3,
  Mistral, SmolLM3, Phi-3,
  DeepSeek V2 / V2-Lite / V3, Mixtral, Qwen3-MoE) and the example plugins' suites
  (examples/*/tests: Granite, Gemma) re-run in a subprocess with ZOO_KERNELS=triton on the CPU
  interpreter, keeping their prefill, decode, greedy and ragged-batch checks (`SUITES`: each
  named test must pass). A new architecture joins by adding its suite there, its tests named
  as the others'.
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
# Every architecture's parity checks (tests/plugins/parity.py), as each suite names them, by
# test file; all of them must be selected, run and pass through the Triton kernels.
PARITY_TESTS = [
    "test_prefill_logits_match",
    "test_decode_steps_match_full_sequence",
    "test_greedy_tokens_identical",
    "test_ragged_batch_at_per_row_positions",  # per-row positions, then a ragged greedy batch
]
# the 2026 families (issues 35, 36): their prefill and decode through the kernels; the greedy
# and ragged-batch paths are the same kernels, run by the suites above. (Nemotron-H's Mamba2
# scan is Granite 4.0-H's, its attention and relu2 MLPs / experts the torch paths: not re-run.)
PREFILL_DECODE = PARITY_TESTS[:2]
EXAMPLE_TESTS = [  # the example plugins' suites (self-contained: no parity.py)
    "test_matches_transformers",  # prefill, decode steps, batch of two, greedy tokens
    "test_ragged_batch_matches_transformers",
]
SUITES = {
    "tests/plugins/test_llama3.py": PARITY_TESTS,
    "tests/plugins/test_qwen2.py": PARITY_TESTS,
    "tests/plugins/test_qwen3.py": PARITY_TESTS,  # q/k norm, sliding windows (ring buffers)
    "tests/plugins/test_mistral.py": PARITY_TESTS,  # a window on every layer
    "tests/plugins/test_smollm3.py": PARITY_TESTS,  # NoPE layers
    # a window on every layer; longrope across its original length, partial rotary
    "tests/plugins/test_phi3.py": [
        *PARITY_TESTS,
        "test_longrope_decode_crosses_the_original_length",
        "test_longrope_greedy_across_the_original_length",
    ],
    # (1 + w) norms, GeGLU, sandwich norms, soft-caps, window / global layers, local rope base
    "tests/plugins/test_gemma.py": PARITY_TESTS,
    "tests/plugins/test_deepseek.py": PARITY_TESTS,
    "tests/plugins/test_mixtral.py": [*PARITY_TESTS, "test_sliding_window_matches_transformers"],
    "tests/plugins/test_qwen3_moe.py": [*PARITY_TESTS, "test_sliding_window_matches_transformers"],
    # sinks, window / full layers, attention biases, and its experts' biases and clamped
    # SwiGLU (the grouped GEMMs' biases; the activation in torch) through Triton
    "tests/plugins/test_gpt_oss.py": [
        *PARITY_TESTS,
        "test_mxfp4_checkpoint_matches_transformers_dequantized",
    ],
    # post-norms only, q/k norms over all heads, window layers on plain rope beside YaRN
    "tests/plugins/test_olmo.py": PREFILL_DECODE,
    # YaRN and the queries' per-position scale; a multimodal checkpoint's text model
    "tests/plugins/test_ministral.py": PREFILL_DECODE,
    # chunked attention (prefill pieces per chunk), NoPE temperature, input-scaled experts
    "tests/plugins/test_llama4.py": PREFILL_DECODE,
    # GLM-4.5: partial half-split rope, q/k/v biases, per-head q/k norms, grouped noaux_tc MoE
    "tests/plugins/test_glm4_moe.py": PREFILL_DECODE,
    # MiniMax M2: q/k norms over all heads at once, sigmoid routing with a correction bias
    "tests/plugins/test_minimax_m2.py": PREFILL_DECODE,
    # DeepSeek sparse attention: the top-k masked latent attention through the MLA kernels
    "tests/plugins/test_deepseek_v32.py": PREFILL_DECODE,
    # hyper-connections, compressed MQA (its attention in torch), hash-routed clamped experts
    "tests/plugins/test_deepseek_v4.py": PREFILL_DECODE,
    # Gemma 4: per-layer inputs, K/V shared between layers, v norms, proportional rope
    "tests/plugins/test_gemma4.py": PREFILL_DECODE,
    # Granite 4.0-H: Mamba2 layers (kernels.ssd_scan) beside NoPE / RoPE attention, the shared
    # MLP with and without routed experts, Granite's multipliers
    "tests/plugins/test_granite_hybrid.py": PREFILL_DECODE,
    # LFM2 / LFM2-MoE: short-conv layers (their conv in torch) beside attention with per-head
    # q/k norms, sigmoid-routed experts with an expert bias
    "tests/plugins/test_lfm2.py": PREFILL_DECODE,
    # Falcon-H1: attention and Mamba2 in parallel on every layer, multipliers folded at load
    "tests/plugins/test_falcon_h1.py": PREFILL_DECODE,
    "examples/zoo-granite/tests/test_zoo_granite.py": EXAMPLE_TESTS,
    "examples/zoo-stablelm/tests/test_zoo_stablelm.py": EXAMPLE_TESTS,
}


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

    # a ragged batch (7 and 11 tokens) in one greedy generation: per-row positions and cache
    # lengths through the decode kernel; each row's tokens are transformers' argmax for that
    # row alone, and their logprobs transformers' (within twice the logit bar)
    prompts = [x[1, :7].tolist(), x[0].tolist()]
    m.reset()
    out = m.generate(prompts, max_new_tokens=STEPS, temperature=0.0, logprobs=1)
    for prompt, res in zip(prompts, out, strict=True):
        logits = ref(torch.tensor([prompt + res.token_ids])).logits[0, len(prompt) - 1 : -1]
        assert res.token_ids == logits.argmax(-1).tolist()
        want = logits.log_softmax(-1)[range(STEPS), res.token_ids]
        lps = torch.tensor([lp.logprob for lp in res.logprobs])
        assert (lps - want).abs().max() <= 2 * BAR * logits.abs().max(), (lps, want)

    # every op went through Triton: forced mode raises rather than falling back
    assert {key[0] for key in dispatch._chosen} >= {"rms_norm", "apply_rope", "attention"}


@pytest.mark.slow
def test_every_parity_model_through_triton():
    # on the CPU interpreter even where a GPU is present: the parity suites expect CPU fp32
    # (on CUDA they would load the checkpoints' bf16); the in-process test covers the GPU
    env = dict(os.environ, ZOO_KERNELS="triton", TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEp", *SUITES]
    names = sorted({name for tests in SUITES.values() for name in tests})
    run = subprocess.run(
        [*cmd, "-k", " or ".join(names)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    # each check ran for every suite: a renamed test would otherwise drop out unnoticed
    passed = [line for line in run.stdout.splitlines() if line.startswith("PASSED ")]
    for suite, tests in SUITES.items():
        for name in tests:
            # a module's own test, or a method of its parity suite class (TestParity::)
            assert any(
                line.startswith(f"PASSED {suite}::") and f"::{name}" in line for line in passed
            ), (suite, name)


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
