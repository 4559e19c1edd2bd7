"""A plain load imports no torch._dynamo (~1.4 s of every load when it did).

Building a model on the meta device must not draw random values or do arithmetic there: both run
torch's Python references, which import torch._dynamo (nn.Embedding's reset_parameters did, and
RMSNorm's `torch.ones(dim) - offset`). Checked in a fresh process, since other tests import it;
`compile=True` imports it legitimately."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import LLAMA32

REPO = Path(__file__).resolve().parents[2]

# Loads each model given on the command line on the CPU; prints, per model, whether
# torch._dynamo was imported by then and, the first time it is, the stack that imported it.
PROBE = """
import importlib.abc, json, sys, traceback
first = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo" and not first:
            first.append("".join(traceback.format_stack(limit=25)))
sys.meta_path.insert(0, Watch())
from core import load_model
for name in sys.argv[1:]:
    load_model(name, device="cpu")
    print(json.dumps([name, "torch._dynamo" in sys.modules, first[0] if first else ""]))
"""


def test_a_plain_cpu_load_imports_no_dynamo(checkpoint):
    folder = checkpoint(LLAMA32)[0]
    # a tiny safetensors folder, and the embedded GGUF model `make run` answers with
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(folder), "smollm2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout
    for line in lines:
        name, imported, stack = json.loads(line)
        assert not imported, f"loading {name} imported torch._dynamo:\n{stack}"
