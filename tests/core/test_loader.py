"""The strict loader: sharded and single files, tying, and every mismatch reported at once."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import LLAMA31, LLAMA32
from safetensors.torch import load_file, save_file

from core import CheckpointError, ConfigError, load_model
from core.loader import map_name, scale_tensor, strip_prefix
from plugins.llama3 import WEIGHT_MAP


def edit_tensors(root, fn):
    f = root / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def logits(m, n=9):
    return m.forward(torch.arange(4, 4 + n)[None])


@torch.no_grad()
def ref_logits(ref, n=9):
    """transformers' logits for the same input as `logits`."""
    return ref(torch.arange(4, 4 + n)[None]).logits


def test_map_name_fuses_and_passes_through():
    assert map_name("model.layers.11.self_attn.k_proj.bias", WEIGHT_MAP) == (
        "model.layers.11.self_attn.qkv_proj.bias",
        "k",
    )
    assert map_name("model.norm.weight", WEIGHT_MAP) == ("model.norm.weight", None)
    assert map_name("model.layers.0.self_attn.rotary_emb.inv_freq", WEIGHT_MAP) is None
    experts = {"model.layers.{}.mlp.experts.{}.up_proj": ("model.layers.{}.mlp.experts.w", "{}.up")}
    assert map_name("model.layers.2.mlp.experts.7.up_proj.weight", experts) == (
        "model.layers.2.mlp.experts.w.weight",
        "7.up",
    )


def test_map_name_whole_tensor_keys():
    """A key naming a whole tensor (transformers 5's stacked experts have no `.weight` leaf)
    maps it to a whole parameter; module keys still take the leaf."""
    e = "model.layers.{}.mlp.experts"
    stacked = {
        f"{e}.gate_up_proj": f"{e}.gate_up_proj.weight",
        e + ".{}.up_proj": (f"{e}.gate_up_proj", "{}.up"),
    }
    assert map_name("model.layers.4.mlp.experts.gate_up_proj", stacked) == (
        "model.layers.4.mlp.experts.gate_up_proj.weight",
        None,
    )
    assert map_name("model.layers.4.mlp.experts.3.up_proj.weight", stacked) == (
        "model.layers.4.mlp.experts.gate_up_proj.weight",
        "3.up",
    )


def test_sharded_equals_single_file(checkpoint, tmp_path):
    root, ref = checkpoint(LLAMA31)
    sharded = tmp_path / "sharded"
    ref.save_pretrained(sharded, max_shard_size="40KB")
    (sharded / "config.json").write_text((root / "config.json").read_text())
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    got = logits(load_model(sharded))
    torch.testing.assert_close(got, logits(load_model(root)), rtol=0, atol=0)
    torch.testing.assert_close(got, ref_logits(ref), rtol=1e-4, atol=1e-4)  # transformers'


def test_loads_straight_into_target_dtype(checkpoint):
    root, _ = checkpoint(LLAMA31)
    m = load_model(root, dtype=torch.float16)
    assert {p.dtype for p in m.net.parameters()} == {torch.float16}
    assert {t.dtype for t in m.net.kv_cache.layer(0)} == {torch.float16}


def test_tied_head_ignores_lm_head_in_file(checkpoint):
    root, ref = checkpoint(LLAMA32)
    before = logits(load_model(root))
    edit_tensors(root, lambda t: t.__setitem__("lm_head.weight", torch.randn(96, 48)))
    after = logits(load_model(root))
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    torch.testing.assert_close(after, ref_logits(ref), rtol=1e-4, atol=1e-4)  # the tied head


def test_untied_head_requires_lm_head(checkpoint):
    root, _ = checkpoint(LLAMA31)
    edit_tensors(root, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"1 missing \(lm_head.weight\)"):
        load_model(root)


def test_every_mismatch_reported_together(checkpoint):
    root, _ = checkpoint(LLAMA31)

    def break_it(t):
        t.pop("model.layers.1.self_attn.k_proj.weight")
        t.pop("model.norm.weight")
        t["model.layers.0.extra.weight"] = torch.zeros(3)
        t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(5, 5)

    edit_tensors(root, break_it)
    with pytest.raises(CheckpointError) as exc:
        load_model(root)
    msg = str(exc.value)
    assert "3 missing" in msg  # k shard, norm, and the up shard whose tensor had the wrong shape
    # named as the checkpoint names them (a user searches their file for it), not the fused shard
    assert "model.layers.1.self_attn.k_proj.weight" in msg and "model.norm.weight" in msg
    assert "model.layers.0.mlp.up_proj.weight" in msg and "qkv_proj" not in msg
    assert "1 unexpected (model.layers.0.extra.weight)" in msg
    assert "1 with the wrong shape" in msg and "[5, 5] but the model needs [80, 64]" in msg
    assert str(root) in msg


def test_index_shard_missing_is_reported_before_loading(checkpoint, tmp_path):
    _, ref = checkpoint(LLAMA31)
    sharded = tmp_path / "s"
    ref.save_pretrained(sharded, max_shard_size="40KB")
    victim = sorted(sharded.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"missing: {victim.name}")):
        load_model(sharded)


def test_index_naming_tensor_no_shard_holds(checkpoint, tmp_path):
    _, ref = checkpoint(LLAMA31)
    sharded = tmp_path / "s"
    ref.save_pretrained(sharded, max_shard_size="40KB")
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.ghost.weight"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"names 1 tensor\(s\) no shard holds: model.ghost"):
        load_model(sharded)


def test_pickle_checkpoints_are_refused(checkpoint):
    root, _ = checkpoint(LLAMA31)
    (root / "model.safetensors").unlink()
    (root / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(
        CheckpointError, match=r"pytorch_model\.bin: pickle checkpoints are refused"
    ):
        load_model(root)


def test_config_not_json(checkpoint):
    root, _ = checkpoint(LLAMA31)
    (root / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        load_model(root)


def test_unknown_model_type_lists_supported_and_suggests(checkpoint):
    root, _ = checkpoint(LLAMA31)
    cfg = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**cfg, "model_type": "lama"}))
    with pytest.raises(ConfigError) as exc:
        load_model(root)
    msg = str(exc.value)
    assert "'lama'" in msg and "supported: " in msg and "Did you mean 'llama'" in msg
    assert "zoo plugins" in msg


def test_prefix_rules_rename_or_skip_a_subtree():
    wm = {"language_model.model.*": "model.*", "vision_tower.*": None}
    assert strip_prefix("language_model.model.layers.3.mlp.up_proj.weight", wm) == (
        "model.layers.3.mlp.up_proj.weight"
    )
    assert strip_prefix("vision_tower.encoder.layers.0.fc1.weight", wm) is None
    assert strip_prefix("vision_towers.x.weight", wm) == "vision_towers.x.weight"  # whole parts
    assert strip_prefix("model.norm.weight", wm) == "model.norm.weight"


def test_scale_tensor_by_a_factor_or_row_segments():
    """A weight scale (DecoderConfig.weight_scales, Falcon-H1's multipliers): a float times the
    whole tensor, or (rows, factor) segments along its first dim, each row times its own."""
    t = torch.ones(5, 3)
    assert torch.equal(scale_tensor(t, 2.0), torch.full((5, 3), 2.0))
    rows = scale_tensor(t, ((2, 3.0), (3, 0.5)))
    assert torch.equal(rows[:, 0], torch.tensor([3.0, 3.0, 0.5, 0.5, 0.5]))
    assert torch.equal(
        scale_tensor(torch.ones(5), ((4, 2.0), (1, 1.0))), torch.tensor([2.0] * 4 + [1.0])
    )
    with pytest.raises(
        CheckpointError, match=r"in_proj\.weight: its multipliers cover 4 rows, but it has 5"
    ):
        scale_tensor(t, ((4, 1.0),), "model.layers.0.mamba.in_proj.weight")
