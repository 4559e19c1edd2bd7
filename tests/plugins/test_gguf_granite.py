"""Granite 4.0-H GGUF files (`granitehybrid`) as llama.cpp's own converter writes them
(tests/fixtures/llama_cpp_convert.py), from test_granite_hybrid's tiny checkpoints in the hub's
config keys, NoPE as the released models: with routed experts + the shared MLP, and without
experts (the Micro: the shared MLP written as the dense MLP). The F32 file loads to the
checkpoint's config and logits (1e-4 relative) and greedy tokens, and decodes on the fused CPU
step.

The file stores neither the context length of a NoPE hybrid (the converter writes 2**20) nor
the scan's chunk length (read as transformers' default, 256, which these checkpoints use)."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
from conftest import make_checkpoint
from fixtures.chat_tokenizers import build_tokenizer_folder
from fixtures.fused_steps import decode, feed, rel_err
from fixtures.llama_cpp_convert import Job, convert_all
from test_gguf_archs import VOCAB, check_same_outputs
from test_granite_hybrid import DENSE, GRANITE, hub_config

from core import load_model
from core.cpu_step import why_not

SPECS = {"moe": GRANITE, "dense": DENSE}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Job]:
    """Both checkpoints (the converter finds the attention layers by "attention": hub keys),
    converted by one converter process."""
    jobs = {}
    for name, spec in SPECS.items():
        root = tmp_path_factory.mktemp(name)
        folder = root / "hf"
        special = build_tokenizer_folder(folder, "qwen2")
        spec = dict(spec, position_embedding_type=None, vocab_size=VOCAB,
                    eos_token_id=special["<|im_end|>"], mamba_chunk_size=256)  # fmt: skip
        make_checkpoint(folder, spec, seed=3)
        hub_config(folder)
        jobs[name] = Job(folder, {"f32": root / "f32.gguf"})
    convert_all(list(jobs.values()))
    return jobs


@pytest.fixture(scope="module", params=list(SPECS))
def loaded(request, converted):
    """(the F32 file, the file loaded, the checkpoint loaded)."""
    job = converted[request.param]
    path = job.outputs["f32"]
    kw = dict(max_seq_len=64, max_batch_size=2, dtype="float32")
    return path, load_model(path, **kw), load_model(job.folder, **kw)


def test_f32_file_equals_the_checkpoint(loaded):
    path, ours, theirs = loaded
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == "granitehybrid"
    assert ours.config.max_position_embeddings == 2**20  # what the converter writes for NoPE
    assert ours.config == dataclasses.replace(theirs.config, max_position_embeddings=2**20)
    check_same_outputs(ours, theirs)


def test_the_file_decodes_on_the_fused_cpu_step(loaded):
    """The file's Mamba2 layers and multipliers run in the fused C step (kernels/cpu/mamba.c),
    equal to the modules step by step."""
    ours = loaded[1]
    assert why_not(ours.net) is None
    tokens = feed()
    for got, want in zip(decode(ours, True, tokens), decode(ours, False, tokens), strict=True):
        assert rel_err(got, want) < 5e-5  # as test_granite_hybrid's fused check


def test_a_file_without_attention_layers_is_refused_by_name(tmp_path):
    """llama.cpp's converter finds the attention layers by layer_types "attention"; from a
    config saved by transformers 5 ("full_attention") it writes head_count_kv 0 everywhere
    (and the attention tensors anyway): refused naming the key and the fix, not as a 0 kv
    heads validation error."""
    from core import ConfigError
    from plugins.formats.gguf_families import configure_granite_hybrid

    meta = {"attention.head_count_kv": [0, 0, 0, 0]}
    with pytest.raises(ConfigError, match=r"head_count_kv is 0 on every layer.*\"attention\""):
        configure_granite_hybrid(lambda k, d=None: meta.get(k, d), {"num_hidden_layers": 4},
                                 tmp_path / "x.gguf")  # fmt: skip
