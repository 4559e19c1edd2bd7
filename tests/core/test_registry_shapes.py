"""Every registry.yaml entry with a `shape` (the real config.json's shape keys) builds, on the
meta device, a model of the entry's `params`: the shape is the published model's, and `zoo list`
shows what Zoo loads (the text model of a multimodal repo; no MTP layers)."""

from __future__ import annotations

import re

import pytest
import torch

from core.hub import named_models
from core.modeling import CausalLM
from core.plugins import registry

SHAPED = {name: e for name, e in named_models().items() if "shape" in e}


def as_written(count: int, like: str) -> str:
    """`count` written as `like` is ('1.24B', '494M', '30.5B', '1.03T'): its unit and decimals."""
    m = re.fullmatch(r"(\d+)(?:\.(\d+))?([MBT])", like)
    assert m, f"params {like!r} is not written as 494M, 1.24B or 1.03T"
    scale = {"M": 1e6, "B": 1e9, "T": 1e12}[m[3]]
    return f"{count / scale:.{len(m[2] or '')}f}{m[3]}"


def test_as_written_can_fail():
    assert as_written(1_236_000_000, "1.24B") == "1.24B"
    assert as_written(1_246_000_000, "1.24B") != "1.24B"
    assert as_written(494_032_768, "494M") == "494M"
    assert as_written(1_026_470_000_000, "1.03T") == "1.03T"


@pytest.mark.parametrize("name", sorted(SHAPED))
def test_registry_shape_builds_the_published_model(name):
    entry = SHAPED[name]
    raw = entry["shape"]
    assert raw["model_type"] == entry["architecture"] or "text_config" in raw
    cfg = registry().architecture(raw["model_type"]).config.from_dict(raw).to_runtime()
    with torch.device("meta"):
        net = CausalLM(cfg)
    count = sum(p.numel() for p in net.parameters())
    assert as_written(count, entry["params"]) == entry["params"]
