"""`zoo run --tp 2` (two gloo ranks started through torch.distributed.run) prints what one
process prints; `torchrun --nproc-per-node 2 -m core.cli run` does too."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import LLAMA32, make_checkpoint
from fixtures.chat_tokenizers import build_tokenizer_folder

ARGS = ["--raw", "-p", "The sky is", "--max-new-tokens", "12", "--device", "cpu"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-tp")
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


def run(*argv: str) -> subprocess.CompletedProcess:
    env_cmd = [sys.executable, *argv]
    return subprocess.run(env_cmd, capture_output=True, text=True, timeout=300)


def test_run_tp2_prints_the_same_greedy_text(folder):
    alone = run("-m", "core.cli", "run", str(folder), *ARGS)
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.strip()  # some text, greedy
    split = run("-m", "core.cli", "run", str(folder), "--tp", "2", *ARGS)
    assert split.returncode == 0, split.stderr
    assert split.stdout == alone.stdout  # rank 0 alone prints
    torchrun = [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "core.cli", "run", str(folder), *ARGS,
    ]  # fmt: skip
    launched = run(*torchrun)
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout == alone.stdout


def test_run_tp_that_does_not_divide_is_one_line_per_rank(folder):
    out = run("-m", "core.cli", "run", str(folder), "--tp", "3", *ARGS)
    assert out.returncode == 1
    assert "tp=3 cannot split num_attention_heads = 4" in out.stderr
    assert "sizes this model allows: 1, 2, 4" in out.stderr
    assert "Traceback" not in out.stderr
    assert "--tp 3: rank" in out.stderr  # the launcher's summary
