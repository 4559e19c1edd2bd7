"""The `zoo` command through a subprocess: output, exit codes, one-line errors."""

from __future__ import annotations

import subprocess
import sys

from conftest import LLAMA32


def zoo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "core.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_info_describes_a_checkpoint(checkpoint):
    root, _ = checkpoint(LLAMA32)
    out = zoo("info", str(root))
    assert out.returncode == 0, out.stderr
    assert "architecture llama" in out.stdout
    assert "4 heads, 2 kv heads, head_dim 16" in out.stdout
    assert "KV bytes     512 per token" in out.stdout  # 2 (K,V) * 2 layers * 2 kv heads * 16 * 4 B


def test_list_shows_named_models():
    out = zoo("list")
    assert out.returncode == 0 and "llama3" in out.stdout


def test_errors_are_one_line_and_nonzero(tmp_path):
    out = zoo("info", str(tmp_path / "missing"))
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("zoo: error:")
    assert "Traceback" not in out.stderr


def test_debug_shows_the_traceback(tmp_path):
    out = zoo("--debug", "info", str(tmp_path / "missing"))
    assert out.returncode != 0 and "Traceback" in out.stderr and "HubError" in out.stderr
