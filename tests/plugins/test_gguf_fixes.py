"""plugins/formats/gguf_fixes.py, beside the whole files of test_gguf_archs.py: a hybrid's file
without multi-token-prediction blocks (as converters before them, or `--no-mtp`, write it),
Qwen3-Next as older converters wrote it (in_proj_qkvz whole), a split in_proj missing its half,
columns that move within blocks read as floats, and Qwen3.5's pre-tokenizer, which keeps
combining marks in words."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file
from test_gguf_archs import (  # noqa: F401  (case and the converted files it reads: fixtures)
    assert_loads_the_same,
    case,
    converted,
    rewritten,
)

from core import CheckpointError, load_model
from plugins.formats.gguf_fixes import Fix, grouped

T = gguf.GGMLQuantizationType


def without_mtp(arch: str, values: dict, tensors: dict) -> None:
    """The file as written without its multi-token-prediction block: one block fewer, no
    nextn count, the recurrent-layer flags of the model's blocks only."""
    mtp = values.pop(f"{arch}.nextn_predict_layers")
    values[f"{arch}.block_count"] -= mtp
    values[f"{arch}.attention.recurrent_layers"] = values[f"{arch}.attention.recurrent_layers"][
        :-mtp
    ]
    for name in [n for n in tensors if n.startswith(f"blk.{values[f'{arch}.block_count']}.")]:
        del tensors[name]


@pytest.mark.parametrize("case", ["qwen35", "qwen3next"], indirect=True)
def test_a_file_without_mtp_blocks_loads_the_same(case, tmp_path):  # noqa: F811
    _, _, path, _ = case
    assert gguf.GGUFReader(path).fields[f"{case[3]}.nextn_predict_layers"].contents() == 1
    short = rewritten(path, tmp_path / "no_mtp.gguf", without_mtp)
    assert_loads_the_same(path, short)


@pytest.mark.parametrize("case", ["qwen35moe", "qwen3next"], indirect=True)
def test_a_shared_expert_gate_stored_as_a_vector_loads_the_same(case, tmp_path):  # noqa: F811
    """llama.cpp's quantizer writes the (1, hidden) gate as a vector (a Q4_K_M download)."""
    _, _, path, _ = case

    def vector(arch, values, tensors):
        for name in [n for n in tensors if n.endswith("ffn_gate_inp_shexp.weight")]:
            assert tensors[name].shape[0] == 1  # the converter's (1, hidden)
            tensors[name] = tensors[name].reshape(-1)

    flat = rewritten(path, tmp_path / "flat.gguf", vector)
    shapes = {t.name: t.shape.tolist() for t in gguf.GGUFReader(flat).tensors}
    assert len(shapes["blk.0.ffn_gate_inp_shexp.weight"]) == 1
    assert_loads_the_same(path, flat)


@pytest.mark.parametrize("case", ["qwen3next"], indirect=True)
def test_qwen3next_file_of_older_converters_loads_the_same(case, tmp_path):  # noqa: F811
    """Before llama.cpp split it (PR 18683, January 2026), the converter stored Qwen3-Next's
    in_proj_qkvz as it is, `ssm_in` (as ollama's converter still reads such files)."""
    _, folder, path, _ = case
    hub = load_file(folder / "model.safetensors")

    def older(arch, values, tensors):
        for name in [n for n in tensors if ".attn_gate." in n]:
            del tensors[name], tensors[name.replace("attn_gate", "attn_qkv")]
            layer = name.split(".")[1]
            qkvz = hub[f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight"].numpy()
            tensors[f"blk.{layer}.ssm_in.weight"] = qkvz

    old = rewritten(path, tmp_path / "older.gguf", older)
    assert "blk.0.ssm_in.weight" in {t.name for t in gguf.GGUFReader(old).tensors}
    assert_loads_the_same(path, old)


@pytest.mark.parametrize("case", ["qwen3next"], indirect=True)
def test_half_of_a_split_in_proj_is_named(case, tmp_path):  # noqa: F811
    def drop(arch, values, tensors):
        del tensors["blk.1.attn_gate.weight"]

    path = rewritten(case[2], tmp_path / "broken.gguf", drop)
    with pytest.raises(
        CheckpointError, match=r"'blk\.1\.attn_qkv\.weight'.*'blk\.1\.attn_gate\.weight'"
    ):
        load_model(path, max_seq_len=16)


def test_value_heads_move_in_whole_blocks_or_are_read_as_floats():
    """out_proj's columns: 4 value heads (2 per key head) back to grouped order. Heads of 32
    columns move as whole Q8_0 / Q4_0 blocks (kept); heads of 16 split Q8_0's blocks, and no
    head of 128 is a whole Q4_K block of 256 (both read as floats)."""
    heads = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                 linear_value_head_dim=8)  # fmt: skip
    cols = grouped(heads, 32)
    assert cols.tolist() == [*range(32), *range(64, 96), *range(32, 64), *range(96, 128)]

    def fix(head_dim: int) -> Fix:
        return Fix(cols=lambda c: grouped(c, head_dim))

    assert fix(32).block_order(heads, T.Q8_0).tolist() == [0, 2, 1, 3]
    assert fix(32).block_order(heads, T.Q4_0).tolist() == [0, 2, 1, 3]
    assert fix(32).keeps_blocks(heads, T.Q8_0)
    assert not fix(16).keeps_blocks(heads, T.Q8_0)
    assert not fix(128).keeps_blocks(heads, T.Q4_K)
    assert fix(32).block_order(heads, T.F32) is None
    assert np.array_equal(grouped(dict(heads, linear_num_value_heads=2), 8), np.arange(16))


@pytest.mark.parametrize("case", ["qwen35"], indirect=True)
def test_qwen35_keeps_combining_marks_in_words(case):  # noqa: F811
    """Qwen3.5's files say tokenizer.ggml.pre `qwen35`: split as its tokenizer.json splits,
    marks (Devanagari's vowel signs, an emoji's variation selector) inside their words."""
    _, folder, path, _ = case
    text = "नमस्ते दुनिया, x̄y ❤️ 123"
    ours, theirs = load_model(path, max_seq_len=16), load_model(folder, max_seq_len=16)
    pieces = [[p for p, _ in m.tokenizer._tok.pre_tokenizer.pre_tokenize_str(text)]
              for m in (ours, theirs)]  # fmt: skip
    assert pieces[0] == pieces[1]
    assert "नमस्ते" in [p.strip() for p in _decoded(pieces[0])]
    assert ours.tokenizer.encode(text) == theirs.tokenizer.encode(text)


def _decoded(pieces: list[str]) -> list[str]:
    """Byte-level pieces (GPT-2's alphabet) back to text."""
    from tokenizers import decoders

    return [decoders.ByteLevel().decode([p]) for p in pieces]
