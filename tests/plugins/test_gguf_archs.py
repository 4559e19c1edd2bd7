"""GGUF files of every architecture Zoo maps, as llama.cpp's own converter writes them.

Each case is a tiny random checkpoint of a built-in family with a small chat tokenizer,
converted by `convert_hf_to_gguf.py` (tests/fixtures/llama_cpp_convert.py): the F32 file loads
to logits equal to the checkpoint's own (1e-4 relative), the same config, the same tokens for
the same text and the same chat template; a Q8_0 file, its blocks kept, meets the project's
standard for kept weights against the same file dequantized (teacher-forced: top-1 >= 99%,
mean KL <= 1e-3), and dequantized holds the F32 file's weights to Q8_0's rounding (the weights
Zoo does not keep, such as gpt-oss's experts, included). An architecture Zoo does not map is
refused with the list of those it does.
"""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from conftest import make_checkpoint
from fixtures.chat_tokenizers import QWEN2, build_tokenizer_folder
from fixtures.llama_cpp_convert import convert
from fixtures.texts import judge
from fixtures.tool_templates import GPT_OSS as HARMONY
from test_gpt_oss import GPT_OSS, to_mxfp4
from test_mixtral import MIXTRAL
from test_qwen3 import QWEN3
from test_qwen3_moe import QWEN3_MOE
from test_smollm3 import SMOLLM3

from core import ConfigError, load_model
from core.quantize import weight_formats
from plugins.gguf import ARCHITECTURES, GGUFCheckpoint

VOCAB = 320  # the tokenizer's ids (300 BPE + specials) fit
CASES = {  # name: (spec, the file's general.architecture)
    "qwen3": (QWEN3, "qwen3"),
    # Qwen3-30B-A3B-style: every layer MoE (llama.cpp's converter has no dense layers in a qwen3moe)
    "qwen3moe": (dict(QWEN3_MOE, mlp_only_layers=[]), "qwen3moe"),
    "mixtral": (MIXTRAL, "llama"),  # llama.cpp writes Mixtral as llama with experts
    "smollm3": (SMOLLM3, "smollm3"),  # NoPE on layer 3
    # llama.cpp runs gpt-oss's SwiGLU clamped at 7, whatever the config says (GPT_OSS: 1.5).
    # Float experts are written split into gate and up, transposed; Q8_0 by --outtype q8_0.
    "gpt-oss": (dict(GPT_OSS, swiglu_limit=7.0), "gpt-oss"),
    # MXFP4 experts, as released: repacked to ggml's MXFP4 whatever the --outtype, so the
    # Q8_0 file holds them as the F32 file does
    "gpt-oss-mxfp4": (dict(GPT_OSS, swiglu_limit=7.0), "gpt-oss"),
}


def released_mxfp4(folder):
    """The experts in MXFP4 and config.json's torch_dtype bfloat16, as openai/gpt-oss-20b's
    (the GGUF file's type, MOSTLY_MXFP4_MOE, reads as bfloat16, as every block format does)."""
    to_mxfp4(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="bfloat16")))


FINISH = {"gpt-oss-mxfp4": released_mxfp4}  # what rewrites a case's saved checkpoint
# a case's tokenizer family and the tokenizer.ggml.pre llama.cpp names its regex by (unlisted:
# Qwen2.5's, `qwen2`); gpt-oss's: o200k's regex, harmony's markers and template
TOKENIZERS = dict.fromkeys(("gpt-oss", "gpt-oss-mxfp4"), (HARMONY, "gpt-4o"))
QWEN25 = (QWEN2, "qwen2")
TEXT = (
    "The quick brown fox, 天空 and 😀: why is the sky blue? Because air scatters light. "
    "It's JSONParser's camelCase 1234567/path\n"
)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, checkpoint folder, its F32 GGUF file, the architecture written)."""
    spec, arch = CASES[request.param]
    family, pre = TOKENIZERS.get(request.param, QWEN25)
    root = tmp_path_factory.mktemp(request.param)
    folder = root / "hf"
    special = build_tokenizer_folder(folder, family)
    spec = dict(spec, vocab_size=VOCAB, bos_token_id=None, eos_token_id=special[family.eos])
    make_checkpoint(folder, spec, seed=3)
    if request.param in FINISH:
        FINISH[request.param](folder)
    return request.param, folder, convert(folder, root / "f32.gguf", pre=pre), arch


def test_the_file_is_llama_cpps(case):
    _, _, path, arch = case
    arch_field = gguf.GGUFReader(path).fields["general.architecture"]
    assert arch_field.contents() == arch
    assert arch in ARCHITECTURES


def test_f32_file_equals_the_checkpoint(case):
    _, folder, path, _ = case
    kw = dict(max_seq_len=64, max_batch_size=2, dtype="float32")  # the file's floats are F32
    ours, theirs = load_model(path, **kw), load_model(folder, **kw)
    assert ours.config == theirs.config
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    want, got = theirs.forward(x), ours.forward(x)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4
    prompt = x[0, :12].tolist()
    want_ids = theirs.generate(prompt, max_new_tokens=8).token_ids
    assert ours.generate(prompt, max_new_tokens=8).token_ids == want_ids


def test_tokenizer_and_chat_template_come_from_the_file(case):
    _, folder, path, _ = case
    ours, theirs = load_model(path, max_seq_len=64), load_model(folder, max_seq_len=64)
    assert ours.tokenizer.encode(TEXT) == theirs.tokenizer.encode(TEXT)
    # the pieces the regex splits TEXT into: the tiny BPE seldom merges across two regexes'
    # different splits, so equal ids alone would not tell them apart
    pieces = [[p for p, _ in m.tokenizer._tok.pre_tokenizer.pre_tokenize_str(TEXT)]
              for m in (ours, theirs)]  # fmt: skip
    assert pieces[0] == pieces[1]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    assert ours.tokenizer.apply_chat_template(chat) == theirs.tokenizer.apply_chat_template(chat)
    assert ours.tokenizer.eos_token_id == theirs.tokenizer.eos_token_id


def test_q8_0_file_kept_meets_the_standard(case, tmp_path):
    """llama.cpp's converter writes the linear weights as Q8_0 blocks; Zoo keeps them as
    stored and is judged as llama.cpp judges a quantization: against the same file
    dequantized, teacher-forced. Dequantized, each weight is the F32 file's to within Q8_0's
    rounding (half a step, the step 1/127 of a block's largest value, in fp16; here bounded by
    the tensor's largest / 200): the weights Zoo reads as floats too, such as gpt-oss's experts."""
    name, folder, f32_path, _ = case
    pre = TOKENIZERS.get(name, QWEN25)[1]
    path = convert(folder, tmp_path / "q8_0.gguf", outtype="q8_0", pre=pre)
    kept = load_model(path, max_seq_len=128)
    floats = load_model(path, max_seq_len=128, dequantize=True)
    assert "q8_0" in weight_formats(kept.net)
    x = torch.randint(0, VOCAB, (1, 120), generator=torch.Generator().manual_seed(1))
    top1, kl = judge(kept.forward(x)[0].float(), floats.forward(x)[0].float())
    assert top1 >= 0.99 and kl <= 1e-3
    got = load_model(path, max_seq_len=8, dequantize=True, dtype="float32").net.named_parameters()
    want = dict(load_model(f32_path, max_seq_len=8, dtype="float32").net.named_parameters())
    for name, w in got:
        assert (w - want[name]).abs().max() <= want[name].abs().max() / 200, name


@pytest.mark.parametrize("case", ["gpt-oss-mxfp4"], indirect=True)
def test_mxfp4_experts_blocks_are_what_is_read(case):
    """The bytes a kept MXFP4 format would take (`blocks`: ggml's block_mxfp4, the gate and up
    rows interleaved as the hub's) dequantize to the weights `read` gives."""
    from gguf.quants import dequantize

    ckpt = GGUFCheckpoint(case[2])
    name = "model.layers.1.mlp.experts.gate_up_proj_blocks"
    kind, raw, order = ckpt.blocks(name)
    assert (kind, order, ckpt.quant_format(name)) == ("mxfp4", None, "mxfp4")
    want = ckpt.read(name)
    assert want.shape == ckpt.shape(name) == (4, 64, 64)
    assert torch.equal(torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType.MXFP4)), want)


def test_an_architecture_not_mapped_is_refused_with_the_list(tmp_path):
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv7")
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError) as err:
        load_model(path)
    message = str(err.value)
    assert "'rwkv7' is not supported" in message
    assert all(arch in message for arch in ARCHITECTURES)
