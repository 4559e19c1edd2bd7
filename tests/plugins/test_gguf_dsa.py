"""DeepSeek V3.2 (`deepseek32`) and GLM-5 (`glm-dsa`) GGUF files, as llama.cpp's own converter
writes them from test_deepseek_v32's tiny checkpoints: the F32 file loads to the checkpoint's
config (indexer keys, GLM-5.1's shared layers from `attention.indexer.types`) and its logits.

Kept apart from test_gguf_archs.py, whose cases also decode on the fused CPU step (which DSA
blocks are refused by). The converters keep the MTP block after the decoder's; Zoo skips it.
`deepseek32` is not in the installed gguf package's constants (its reader does not need it).
Tokenizers: Llama 3's regex for V3.2, GLM's special tokens (the converter's GLM vocabulary
names [gMASK], <|user|>, <|observation|>) on Qwen2.5's regex for GLM-5. The V3.2 converter
asserts `tokenizer.add_bos_token`, which transformers 5 drops from tokenizer_config.json when a
tokenizer.json is present: that folder gives the BPE as vocab.json + merges.txt instead.
"""

from __future__ import annotations

import dataclasses
import json

import gguf
import pytest
import torch
from fixtures.chat_tokenizers import LLAMA3, QWEN2, build_tokenizer_folder
from fixtures.llama_cpp_convert import Job, convert_all
from test_deepseek_v32 import GLM, V32, make_dsa

from core import load_model

VOCAB = 320
GLM_TOKENIZER = dataclasses.replace(
    QWEN2,
    name="glm",
    specials=(
        "<|endoftext|>",
        "[MASK]",
        "[gMASK]",
        "[sMASK]",
        "<sop>",
        "<eop>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|observation|>",
    ),
    eos="<|user|>",
    tokenizer_class="PreTrainedTokenizerFast",
)
# YaRN's mscale equal to mscale_all_dim, as in V3.2's config: llama.cpp stores the one and
# runs both as it (see gguf_families.configure_deepseek2)
V32_FILE = dict(V32, rope_parameters=dict(V32["rope_parameters"], mscale_all_dim=1.0))
# name: (spec, tokenizer, its pre-tokenizer name, the file's general.architecture)
CASES = {
    "v3.2": (V32_FILE, LLAMA3, "llama-bpe", "deepseek32"),
    "glm-5": (GLM, GLM_TOKENIZER, "qwen2", "glm-dsa"),
}


def bpe_as_vocab_and_merges(folder) -> None:
    """tokenizer.json's byte-level BPE as vocab.json + merges.txt, with add_bos_token kept."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    (folder / "vocab.json").write_text(json.dumps(tok["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (folder / "tokenizer.json").unlink()
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(add_bos_token=True, tokenizer_class="GPT2Tokenizer")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def make_case(name: str, root) -> Job:
    """Write case `name`'s checkpoint under root/hf; its conversion job (an F32 file)."""
    spec, tokenizer, pre, arch = CASES[name]
    folder = root / "hf"
    special = build_tokenizer_folder(folder, tokenizer)
    bos = special.get(tokenizer.bos) if tokenizer.bos else None
    ids = dict(vocab_size=VOCAB, eos_token_id=special[tokenizer.eos], bos_token_id=bos)
    make_dsa(folder, dict(spec, **ids))
    if arch == "deepseek32":
        bpe_as_vocab_and_merges(folder)
    return Job(folder, {"f32": root / "f32.gguf"}, pre)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Job]:
    """Both cases' checkpoints, converted by one converter process."""
    jobs = {name: make_case(name, tmp_path_factory.mktemp(name)) for name in CASES}
    convert_all(list(jobs.values()))
    return jobs


@pytest.fixture(scope="module", params=list(CASES))
def case(request, converted):
    """(folder, its F32 GGUF file, the architecture written)."""
    job = converted[request.param]
    return job.folder, job.outputs["f32"], CASES[request.param][3]


@torch.no_grad()
def test_f32_file_equals_the_checkpoint(case):
    folder, path, arch = case
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == arch
    kw = dict(max_seq_len=64, max_batch_size=2, dtype="float32")
    ours, theirs = load_model(path, **kw), load_model(folder, **kw)
    # GLM's converter names [gMASK] the BOS and adds <|observation|> as an end of turn
    ids = dict(bos_token_id=None, eos_token_ids=())
    assert dataclasses.replace(ours.config, **ids) == dataclasses.replace(theirs.config, **ids)
    assert ours.config.mtp_layers == 1
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    want, got = theirs.forward(x), ours.forward(x)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4
