"""Model.embed against transformers on tiny random checkpoints (fp32): AutoModel's
last_hidden_state (after the final norm) of each text alone, pooled by hand, equals the
embedding of the same text in a right-padded batch of unequal lengths; the pooling is read from
the checkpoint's sentence-transformers files (mean, last token, with and without Normalize)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import LLAMA32, chat_llama_folder
from fixtures.embeddings import reference, rel, write_sentence_transformers

from core import load_model
from core.embedding import Pooling, read_pooling
from core.errors import CheckpointError, RequestError

# Qwen3-Embedding-style: q/k norms, head_dim != hidden / heads, and a sliding window of 5 on
# layer 1 (inputs longer than the window: the ring buffer must not lose what pooling reads)
QWEN3 = dict(
    model_type="qwen3",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    use_sliding_window=True,
    sliding_window=5,
    max_window_layers=1,
    bos_token_id=1,
    eos_token_id=2,
)
SPECS = {"llama": LLAMA32, "qwen3": QWEN3}
LENGTHS = [7, 1, 13, 4, 9]  # unequal; 5 texts in batches of 3: a second, partial batch


@pytest.fixture(scope="module", params=list(SPECS))
def folder(request, tmp_path_factory):
    """(checkpoint folder, transformers AutoModel of it: the base model, no LM head)."""
    from conftest import make_checkpoint
    from transformers import AutoModel

    root, _ = make_checkpoint(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    return root, AutoModel.from_pretrained(root, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "mode,normalize",
    [("mean_tokens", False), ("mean_tokens", True), ("lasttoken", False), ("lasttoken", True)],
)
def test_embed_equals_transformers(folder, mode, normalize):
    root, base = folder
    write_sentence_transformers(root, mode, normalize)
    model = load_model(root, max_batch_size=3, max_seq_len=32, dtype="float32")
    want_mode = "mean" if mode == "mean_tokens" else "last"
    assert model.pooling.modes == (want_mode,) and model.pooling.normalize == normalize
    g = torch.Generator().manual_seed(3)
    texts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in LENGTHS]
    got = model.embed(texts)
    assert got.shape == (len(texts), base.config.hidden_size) and got.dtype == torch.float32
    for i, ids in enumerate(texts):
        want = reference(base, ids, want_mode, normalize)
        assert rel(got[i], want) < 1e-4, (i, rel(got[i], want))
    if normalize:
        assert torch.allclose(got.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)
    one = model.embed(texts[2])  # one text: (hidden,), as in the batch
    assert one.shape == (base.config.hidden_size,) and rel(one, got[2]) < 1e-5
    # the other pooling, asked for in the call
    other = "last" if want_mode == "mean" else "mean"
    flipped = model.embed(texts[:2], pooling=other, normalize=not normalize)
    assert rel(flipped[0], reference(base, texts[0], other, not normalize)) < 1e-4


def test_embed_text_through_tokenizer(tmp_path):
    """Texts are encoded as prompts (the tokenizer's BOS included), as transformers'
    tokenizer(text) encodes them; no sentence-transformers files: the mean, not normalized."""
    from transformers import AutoModel, AutoTokenizer

    root = chat_llama_folder(tmp_path / "chat")
    model = load_model(root, max_batch_size=2, dtype="float32")
    assert model.pooling == Pooling()
    texts = ["Why is the sky blue?", "Hi", "天空 😀 hello"]
    got = model.embed(texts)
    base = AutoModel.from_pretrained(root, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(root)
    for i, text in enumerate(texts):
        assert rel(got[i], reference(base, tok(text)["input_ids"], "mean", False)) < 1e-4


def test_pooling_by_kind(tmp_path):
    """No sentence-transformers files: a Qwen3-Embedding-style repo (by its name, in a folder
    or in the hub cache) pools the last token,
    L2-normalized (as its model card does); anything else the mean."""
    (tmp_path / "Qwen3-Embedding-0.6B").mkdir()
    got = read_pooling(tmp_path / "Qwen3-Embedding-0.6B")
    assert (got.modes, got.normalize) == (("last",), True)
    assert read_pooling(tmp_path) == Pooling()
    cached = tmp_path / "models--Qwen--Qwen3-Embedding-0.6B" / "snapshots" / "c54f2e6e"
    cached.mkdir(parents=True)  # the hub cache's layout: the repo's name, not the hash
    assert read_pooling(cached).source == "an embedding repo's name: Qwen/Qwen3-Embedding-0.6B"


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda r: write_sentence_transformers(r, "weightedmean_tokens", False), "weightedmean"),
        (lambda r: (r / "modules.json").write_text("[{"), "not readable JSON"),
        (lambda r: (r / "modules.json").write_text(json.dumps(
            [{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}])), "Dense"),
        (lambda r: write_sentence_transformers(r, "none", False), "no pooling_mode"),
    ],
)  # fmt: skip
def test_bad_sentence_transformers_files(tmp_path, mutate, match):
    write_sentence_transformers(tmp_path, "mean_tokens", False)
    mutate(tmp_path)
    with pytest.raises(CheckpointError, match=match):
        read_pooling(tmp_path)


def test_embed_errors(folder):
    root, _ = folder
    model = load_model(root, max_seq_len=16)
    with pytest.raises(RequestError, match=r"input 1 \(20 tokens\) exceeds the context length"):
        model.embed([[5, 6], [7] * 20])
    with pytest.raises(RequestError, match="empty list"):
        model.embed([])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        model.embed([[5, 999]])
    with pytest.raises(RequestError, match="unknown pooling"):
        model.embed([[5]], pooling="median")
