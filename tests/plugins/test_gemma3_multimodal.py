"""A multimodal Gemma 3 checkpoint (`model_type: gemma3`, Gemma3ForConditionalGeneration) loads
its text model only: the config's `text_config` is read, the vision tower and the multimodal
projector are skipped whole by the weight map's prefix rules, and text logits equal
transformers' on text input (fp32), under the hub's names (`language_model.model.*`, what
transformers 5.23 writes) and under transformers 5's in-memory names (`model.language_model.*`)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import randomize
from parity import check_decode, check_greedy, check_prefill, ids
from safetensors.torch import load_file, save_file

from core import CheckpointError, ConfigError, load_model

VOCAB = 96
# window 5 < the test sequences; layers 0, 1 windowed at local base 100, layer 2 global with a
# linearly stretched theta; q/k norms; a tied head as the releases
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    sliding_window=5,
    sliding_window_pattern=3,
    query_pre_attn_scalar=24,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
# a SigLIP tower of one layer: 28 / 14 = 2 patches a side, pooled to 4 image tokens
VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)


def write_gemma3(root, names: str = "hub"):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = Gemma3Config(
        text_config=TEXT,
        vision_config=VISION,
        mm_tokens_per_image=4,
        boi_token_index=93,
        eoi_token_index=94,
        image_token_index=95,
    )
    torch.manual_seed(0)
    ref = Gemma3ForConditionalGeneration(cfg).eval()
    randomize(ref)
    ref.save_pretrained(root, safe_serialization=True)
    path = root / "model.safetensors"
    tensors = load_file(path)
    assert any(n.startswith("vision_tower.") for n in tensors)  # the tower is really there
    assert any(n.startswith("multi_modal_projector.") for n in tensors)
    if names == "transformers5":  # the names Gemma3ForConditionalGeneration's modules carry
        rename = {
            "language_model.model.": "model.language_model.",
            "vision_tower.": "model.vision_tower.",
            "multi_modal_projector.": "model.multi_modal_projector.",
        }
        out = {}
        for n, t in tensors.items():
            old = next(p for p in (*rename, "") if n.startswith(p))
            out[(rename[old] + n[len(old) :]) if old else n] = t
        save_file(out, path, metadata={"format": "pt"})
    return root, ref


@pytest.fixture(scope="module", params=["hub", "transformers5"])
def gemma3(request, tmp_path_factory):
    root, ref = write_gemma3(tmp_path_factory.mktemp(request.param), request.param)
    return load_model(root, max_seq_len=64), ref


def test_text_logits_match_transformers(gemma3):
    m, ref = gemma3
    assert m.config.model_type == "gemma3" and m.config.num_layers == 3
    check_prefill(m, ref, ids(VOCAB - 4, 1, 20))  # 4x the window; no image tokens


def test_decode_steps_match_full_sequence(gemma3):
    m, ref = gemma3
    check_decode(m, ref, ids(VOCAB - 4, 1, 16, seed=3), prefill=4)


def test_greedy_tokens_identical(gemma3):
    m, ref = gemma3
    check_greedy(m, ref, ids(VOCAB - 4, 1, 6, seed=5))


def test_no_vision_parameter_is_built(gemma3):
    m, _ = gemma3
    names = [n for n, _ in m.net.named_parameters()]
    assert not [n for n in names if "vision" in n or "multi_modal" in n]


def test_strict_outside_the_skipped_prefixes(tmp_path):
    """Only the declared prefixes are skipped: a stray tensor elsewhere is still refused."""
    root, _ = write_gemma3(tmp_path)
    tensors = load_file(root / "model.safetensors")
    tensors["vision_towers.extra.weight"] = torch.zeros(2)
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"vision_towers\.extra\.weight"):
        load_model(root, max_seq_len=16)


def test_missing_text_config_is_named(tmp_path):
    root, _ = write_gemma3(tmp_path)
    cfg = json.loads((root / "config.json").read_text())
    del cfg["text_config"]
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="text_config"):
        load_model(root, max_seq_len=16)
