"""Falcon-H1 GGUF files (`falcon-h1`) as llama.cpp's own converter writes them
(tests/fixtures/llama_cpp_convert.py), from test_falcon_h1's tiny checkpoint with the gated
Mamba2 norm (gate first: what llama.cpp's graph runs) and without biases (the converter scales
a bias as its weight, and fails on in_proj's: the releases have none). The converter folds
every muP multiplier into the weights, the embedding and the head included, so the file's
model has none; the F32 file loads to the checkpoint's logits (1e-4 relative) and greedy
tokens. The file does not store the scan's chunk length (read as transformers' default, 256,
which this checkpoint uses)."""

from __future__ import annotations

import gguf
import pytest
from conftest import make_checkpoint
from fixtures.chat_tokenizers import build_tokenizer_folder
from fixtures.llama_cpp_convert import convert
from test_falcon_h1 import FALCON
from test_gguf_archs import VOCAB, check_same_outputs

from core import load_model

NO_BIASES = dict(attention_bias=False, mlp_bias=False, mamba_proj_bias=False,
                 projectors_bias=False)  # fmt: skip


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """(the F32 file, the file loaded, the checkpoint loaded)."""
    root = tmp_path_factory.mktemp("falcon_h1_gguf")
    folder = root / "hf"
    special = build_tokenizer_folder(folder, "qwen2")
    spec = dict(FALCON, **NO_BIASES, mamba_rms_norm=True, vocab_size=VOCAB, mamba_chunk_size=256,
                eos_token_id=special["<|im_end|>"])  # fmt: skip
    make_checkpoint(folder, spec, seed=3)
    path = convert(folder, root / "f32.gguf")
    kw = dict(max_seq_len=64, max_batch_size=2, dtype="float32")
    return path, load_model(path, **kw), load_model(folder, **kw)


def test_f32_file_equals_the_checkpoint(loaded):
    path, ours, theirs = loaded
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == "falcon-h1"
    mixer = ours.config.attention_layers[0]
    assert mixer == theirs.config.attention_layers[0]  # sizes, norm and biases read back
    assert mixer.mamba.gated_norm == "gate_first"
    # the multipliers are in the file's weights, not its config
    assert ours.config.embedding.scale == 1.0 and ours.config.logits_scale == 1.0
    check_same_outputs(ours, theirs)
