"""A plain, non-editable `pip install .` works from another directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from conftest import LLAMA32

from kernels.cpu.build import HEADERS, SOURCES

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import json, sys, torch, core
from core import load_model
from core.catalog import named_models, registry_path
m = load_model(sys.argv[1])
logits = m.forward(torch.arange(4, 12)[None])
print(json.dumps({"core": core.__file__, "registry": str(registry_path()),
                  "models": sorted(named_models()), "logits": logits.flatten().tolist()}))
"""


def test_wheel_install_outside_repo_loads_a_checkpoint(checkpoint, tmp_path):
    root, ref = checkpoint(LLAMA32)
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(REPO)],
        check=True, cwd=tmp_path, capture_output=True, timeout=300,
    )  # fmt: skip
    # the C kernels ship as sources, compiled on first use by the installed copy
    assert all((site / "kernels" / "cpu" / src.name).is_file() for src in [*SOURCES, *HEADERS])
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["core"].startswith(str(site))  # the installed copy, not the checkout
    assert got["registry"] == str(site / "core" / "registry.yaml")  # shipped as package data
    assert "llama3" in got["models"]
    want = ref(torch.arange(4, 12)[None]).logits.flatten()
    torch.testing.assert_close(torch.tensor(got["logits"]), want, rtol=1e-4, atol=1e-4)
    # the console script is installed too
    cli = subprocess.run(
        [str(site / "bin" / "zoo"), "info", str(root)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert "architecture llama" in cli.stdout
