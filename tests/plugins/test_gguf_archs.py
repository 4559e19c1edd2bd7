"""GGUF files of every architecture Zoo maps, as llama.cpp's own converter writes them.

Each case is a tiny random checkpoint of a built-in family with a small chat tokenizer (Gemma's:
a sentencepiece one, the only kind its converters read), converted by `convert_hf_to_gguf.py`
(tests/fixtures/llama_cpp_convert.py): the F32 file loads to logits equal to the checkpoint's
own (1e-4 relative), the same config, the same tokens for the same text and the same chat
template; a Q8_0 file, its blocks kept, meets the project's standard for kept weights against
the same file dequantized (teacher-forced: top-1 >= 99%, mean KL <= 1e-3). An architecture Zoo
does not map is refused with the list of those it does. Dequantized, the Q8_0 file holds the
F32 file's weights to Q8_0's rounding (the weights Zoo does not keep included).
DeepSeek files as llama.cpp's older converters wrote them (MLA's kv_b_proj whole) load the same.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import make_checkpoint
from fixtures.chat_tokenizers import (
    QWEN2,
    QWEN35_PATTERN,
    build_sentencepiece_folder,
    build_tokenizer_folder,
)
from fixtures.fused_steps import decode, deepseek_checkpoint, feed, rel_err
from fixtures.gemma_tokenizer import build_gemma_tokenizer_folder
from fixtures.llama_cpp_convert import Job, convert, convert_all
from fixtures.texts import judge
from fixtures.tool_templates import GPT_OSS as HARMONY
from safetensors.torch import load_file, save_file
from test_deepseek import V3, make_deepseek
from test_gemma import GEMMA, GEMMA2, GEMMA3, gemma_checkpoint
from test_glm4_moe import GLM45, make_glm
from test_gpt_oss import GPT_OSS, to_mxfp4
from test_lfm2 import LFM2
from test_minimax_m2 import MINIMAX_M2, make_minimax
from test_mistral import MISTRAL_V03
from test_mixtral import MIXTRAL
from test_nemotron_h import DENSE as NEMOTRON_H_DENSE
from test_nemotron_h import MOE as NEMOTRON_H_MOE
from test_nemotron_h import make as make_nemotron_h
from test_phi3 import PHI3_MINI, PHI4_MINI, ROT
from test_qwen3 import QWEN3
from test_qwen3_moe import QWEN3_MOE
from test_qwen3_next import QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT
from test_smollm3 import SMOLLM3

from core import CheckpointError, ConfigError, load_model
from core.cpu_step import why_not
from core.layers.moe import StackedLinear
from core.quantize import weight_formats
from kernels.blocks import BlockExperts
from kernels.qweight import QuantExperts
from plugins.formats.gguf import ARCHITECTURES, GGUFCheckpoint

VOCAB = 320  # the tokenizers' ids (300 BPE or 305 sentencepiece pieces + specials) fit;
# Gemma's vocabulary is larger (512)


def deepseek(case: str, **changes):
    """A maker of test_deepseek's DeepSeek checkpoints as the hub ships them (one tensor per
    expert, the hub's config keys): (folder, **spec changes) -> None."""
    return lambda folder, **kw: make_deepseek(folder, case, **changes, **kw)


def hybrid(spec: dict):
    """A maker of Qwen's hybrids as released: saved as transformers 5 writes them
    (rope_parameters: the partial rotary factor, Qwen3.5's mrope sections), with the
    multi-token-prediction weights (mtp.*), which llama.cpp's converter writes as blocks after
    the model's (and Zoo does not run)."""

    def make(folder, **changes):
        make_checkpoint(folder, dict(spec, **changes), seed=3, raw=True)
        path = folder / "model.safetensors"
        state = load_file(path)
        last = f"model.layers.{spec['num_hidden_layers'] - 1}."  # the MTP layer: one like it
        state.update({k.replace(last, "mtp.layers.0."): v for k, v in state.items() if last in k})
        hidden = spec["hidden_size"]
        state["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden) / hidden  # embedding | hidden
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            state[f"mtp.{norm}.weight"] = torch.zeros(hidden)
        save_file({k: v.contiguous().clone() for k, v in state.items()}, path, {"format": "pt"})

    return make


DEEPSEEK_DENSE = dict(
    V3,
    model_type="deepseek_v2",
    first_k_dense_replace=V3["num_hidden_layers"],
    rope_scaling=dict(V3["rope_scaling"], mscale_all_dim=1.0),
)
# The hybrids' MoE layers route each token to all 4 experts. With 2 of 4, the random routers'
# near-ties flip between the kept and the dequantized model (the CPU kernels round activations
# to 15 bits; the DeltaNet layers' gated norm amplifies that for heads whose output nearly
# cancels), and the Q8_0 judgement measured those flips (mean KL 6e-4 to 1e-2 over seeds);
# with all 4 it is 3e-5 to 6e-5, and a misplaced expert still moves the F32 logits (each
# expert weighted by its own probability). Experts 32 wide, as qwen3moe's.
HYBRID_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=4)

# GLM's tokenizer specials: the converter names [gMASK] its BOS, <|user|> its EOT, <|observation|>
# its EOM, which GLM's config.json lists as EOS beside <|endoftext|>
GLM4_TOKENIZER = dataclasses.replace(
    QWEN2, name="glm4", eos="<|endoftext|>", pad="<|endoftext|>",
    specials=("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
              "<|observation|>"),
)  # fmt: skip


def glm4moe(folder, **changes):
    """test_glm4_moe's GLM-4.5 with its MTP layer (the converter writes it as a block after
    the model's), its token ids as GLM's config.json has them; experts 32 wide, as qwen3moe's."""
    added = json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    ids = {t["content"]: int(i) for i, t in added.items()}
    eos = [ids[t] for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    changes.update(bos_token_id=ids["[gMASK]"], eos_token_id=eos)
    make_glm(folder, dict(GLM45, moe_intermediate_size=32, **changes))


def nemotron_h(spec: dict, intermediate: int = 64):
    """A maker of test_nemotron_h's hub-style checkpoints (backbone.*, hybrid_override_pattern,
    a random routing bias) with what the converter does not store at the releases' values:
    chunk_size 128, and max_position_embeddings its 2 ** 20 (no rope); widths of 32 and 64 so
    that the MLPs' and experts' down projections are written in blocks too (`intermediate`:
    the MLP's; a file without MLP layers says the experts', as Nemotron 3 Nano's config)."""
    widths = dict(intermediate_size=intermediate, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=64)  # fmt: skip
    return lambda folder, **kw: make_nemotron_h(
        folder, dict(spec, chunk_size=128, max_position_embeddings=2**20, **widths, **kw), seed=3
    )


CASES = {  # name: (spec or maker, the file's general.architecture)
    "qwen3": (QWEN3, "qwen3"),
    # Qwen3-30B-A3B-style: every layer MoE (llama.cpp's converter has no dense layers in a qwen3moe)
    # (experts 32 wide, so that the converter writes their down projections in blocks too)
    "qwen3moe": (dict(QWEN3_MOE, mlp_only_layers=[], moe_intermediate_size=32), "qwen3moe"),
    "mixtral": (MIXTRAL, "llama"),  # llama.cpp writes Mixtral as llama with experts
    "smollm3": (SMOLLM3, "smollm3"),  # NoPE on layer 3
    "phi3": (PHI3_MINI, "phi3"),  # a window on every layer
    # Phi-4-mini-style: LongRoPE on 3/4 of each head; the factors float32 values, as the file
    # stores them (and Phi-3's hub configs spell them)
    "phi3-longrope": (
        dict(
            PHI4_MINI,
            rope_scaling=dict(
                PHI4_MINI["rope_scaling"], short_factor=[1.0 + i / 8 for i in range(ROT)]
            ),
        ),
        "phi3",
    ),
    "mistral": (MISTRAL_V03, "llama"),  # llama.cpp writes Mistral as llama
    # plain q_proj, softmax greedy routing, 2 shared experts, YaRN with mscale 0.707
    "deepseek2-v2-lite": (deepseek("v2-lite"), "deepseek2"),
    # q_lora, sigmoid routing with a correction bias over 4 groups, scaled; YaRN's mscale equal
    # to mscale_all_dim, as in V3's config (llama.cpp stores the one and runs both as it)
    "deepseek2-v3": (
        deepseek("v3", rope_scaling=dict(V3["rope_scaling"], mscale_all_dim=1.0)),
        "deepseek2",
    ),
    # V3's MLA (q_lora) with every MLP dense (first_k_dense_replace: all 3), as deepseek_v2
    # (what a deepseek2 file without experts loads as): what the fused CPU step takes
    "deepseek2-dense": (
        lambda folder, **changes: deepseek_checkpoint(folder, dict(DEEPSEEK_DENSE, **changes)),
        "deepseek2",
    ),
    # Gemma's (1 + w) norms; Gemma 2's window (5), soft-caps and sandwich norms; Gemma 3's q/k norms
    # and local rope base beside a linearly scaled global one. llama.cpp implies what the
    # converter leaves out, and the checkpoints have it so: Gemma 2 at the 27B's layer count (46)
    # scales scores by hidden / heads (48 / 4), Gemma 3 (any other count) by head_dim (16);
    # Gemma 3's window pattern is 6 (5 windowed, 1 global)
    "gemma": (GEMMA, "gemma"),
    "gemma2": (dict(GEMMA2, num_hidden_layers=46, query_pre_attn_scalar=12), "gemma2"),
    "gemma3": (dict(GEMMA3, sliding_window_pattern=6, query_pre_attn_scalar=16), "gemma3"),
    # llama.cpp runs gpt-oss's SwiGLU clamped at 7, whatever the config says (GPT_OSS: 1.5).
    # Float experts are written split into gate and up, transposed; Q8_0 by --outtype q8_0.
    "gpt-oss": (dict(GPT_OSS, swiglu_limit=7.0), "gpt-oss"),
    # MXFP4 experts, as released: repacked to ggml's MXFP4 whatever the --outtype, so the
    # Q8_0 file holds them as the F32 file does
    "gpt-oss-mxfp4": (dict(GPT_OSS, swiglu_limit=7.0), "gpt-oss"),
    # gated DeltaNet (2 key heads to 4 value heads) and gated attention, 3 to 1, (1 + w) norms:
    # Qwen3.5's value heads stored reordered, Qwen3-Next's in_proj_qkvz split in two; every
    # layer MoE with a gated shared expert (the converter writes no dense one in a qwen3next)
    "qwen3next": (hybrid(dict(QWEN3_NEXT, mlp_only_layers=[], **HYBRID_MOE)), "qwen3next"),
    "qwen35": (hybrid(QWEN3_5), "qwen35"),
    "qwen35moe": (hybrid(dict(QWEN3_5_MOE, **HYBRID_MOE)), "qwen35moe"),
    # Mamba2, NoPE attention and relu2 MLP / MoE layers, one norm each. The converter writes
    # every nemotron_h whose config has num_experts_per_tok, which transformers 5 fills in, as
    # nemotron_h_moe: the dense Nano 2 pattern too. The MoE one as Nemotron 3 Nano's, no MLP
    # layer (a nemotron_h_moe file writes an MLP layer's width as 0); sigmoid routing, top-2
    # of 8 in 1 of 2 groups with a correction bias, a shared expert
    "nemotron_h": (nemotron_h(NEMOTRON_H_DENSE), "nemotron_h_moe"),
    "nemotron_h_moe": (
        nemotron_h(dict(NEMOTRON_H_MOE, layers_block_type="M*EME"), 32),
        "nemotron_h_moe",
    ),
    # GQA with q/k/v biases and q/k norms, half-rotated heads, a dense first layer, grouped
    # sigmoid routing with a correction bias, a shared expert; the MTP layer not run
    "glm4moe": (glm4moe, "glm4moe"),
    # q/k norms over all heads, half-rotated heads, sigmoid routing with a correction bias
    # (the converter takes no MTP module: the released checkpoints ship none)
    "minimax-m2": (
        lambda folder, **changes: make_minimax(
            folder, spec=dict(MINIMAX_M2, intermediate_size=32, **changes), mtp=False
        ),
        "minimax-m2",
    ),
    # gated short-conv layers (a 4-tap conv, stored 2-D) beside attention with q/k norms; the
    # final norm stored as token_embd_norm, kv heads per layer (0: conv); no conv biases (the
    # converter and llama.cpp's graph take none)
    "lfm2": (dict(LFM2, conv_bias=False), "lfm2"),
}


def released_mxfp4(folder):
    """The experts in MXFP4 and config.json's torch_dtype bfloat16, as openai/gpt-oss-20b's
    (the GGUF file's type, MOSTLY_MXFP4_MOE, reads as bfloat16, as every block format does)."""
    to_mxfp4(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="bfloat16")))


FINISH = {"gpt-oss-mxfp4": released_mxfp4}  # what rewrites a case's saved checkpoint
# the model_type a file loads as, where it cannot say the checkpoint's: llama.cpp writes Mistral
# as llama, the same network (v0.1's window is dropped: llama.cpp runs it without one)
LOADS_AS = {"mistral": "llama"}
# each case's tokenizer, Qwen2.5's unless named here. Phi-3-mini and Mistral ship a
# sentencepiece tokenizer.model (the file's vocabulary: llama); Phi-4-mini a byte-level BPE,
# which the converter reads as one only where tokenizer_config says GPT2Tokenizer, as it does
TOKENIZERS = {
    "phi3": "sentencepiece",
    "mistral": "sentencepiece",
    "phi3-longrope": dataclasses.replace(QWEN2, tokenizer_class="GPT2Tokenizer"),
    # gpt-oss's: o200k's regex, harmony's markers and template
    "gpt-oss": HARMONY,
    "gpt-oss-mxfp4": HARMONY,
    # Qwen3.5's: Qwen2.5's regex with combining marks kept in words
    **dict.fromkeys(("qwen35", "qwen35moe"), dataclasses.replace(QWEN2, pattern=QWEN35_PATTERN)),
    "glm4moe": GLM4_TOKENIZER,
}
# the tokenizer.ggml.pre llama.cpp names a case's regex by (unlisted: Qwen2.5's, `qwen2`)
PRE = {"gpt-oss": "gpt-4o", "gpt-oss-mxfp4": "gpt-4o", "qwen35": "qwen35", "qwen35moe": "qwen35"}
GEMMA_IDS = {"bos_token_id": "<bos>", "eos_token_id": "<end_of_turn>", "pad_token_id": "<pad>"}
TEXT = (
    "The quick brown fox, 天空 and 😀: why is the sky blue? Because air scatters light. "
    "It's JSONParser's camelCase 1234567/path\n"
)


def make_case(name: str, root: Path) -> Job:
    """Write case `name`'s hub-style checkpoint under root/hf; its conversion job (F32 and, for
    test_q8_0_file_..., Q8_0 files beside it)."""
    spec, arch = CASES[name]
    folder = root / "hf"
    if arch.startswith("gemma"):  # in the released repos' config keys
        special = build_gemma_tokenizer_folder(folder)
        ids = {k: special[t] for k, t in GEMMA_IDS.items()}
        gemma_checkpoint(folder, dict(spec, **ids, vocab_size=special["vocab_size"]))
    else:
        tokenizer = TOKENIZERS.get(name, "qwen2")
        if tokenizer == "sentencepiece":
            special = build_sentencepiece_folder(folder)
        else:
            special = build_tokenizer_folder(folder, tokenizer)
        eos = special[getattr(tokenizer, "eos", "<|im_end|>")]
        bos = special.get("<s>")
        changes = dict(vocab_size=VOCAB, bos_token_id=bos, eos_token_id=eos)
        if callable(spec):  # a family whose own test module makes its hub-style checkpoints
            spec(folder, **changes)
        else:
            make_checkpoint(folder, dict(spec, **changes), seed=3)
    if name in FINISH:
        FINISH[name](folder)
    outputs = {"f32": root / "f32.gguf", "q8_0": root / "q8_0.gguf"}
    return Job(folder, outputs, PRE.get(name, "qwen2"))


@pytest.fixture(scope="module")
def converted(request, tmp_path_factory) -> dict[str, Job]:
    """The cases this run's tests use, converted by one converter process."""
    mine = [item for item in request.session.items if item.module is request.module]
    used = {item.callspec.params.get("case") for item in mine if hasattr(item, "callspec")}
    jobs = {name: make_case(name, tmp_path_factory.mktemp(name)) for name in CASES if name in used}
    convert_all(list(jobs.values()))
    return jobs


@pytest.fixture(scope="module", params=list(CASES))
def case(request, converted):
    """(name, checkpoint folder, its F32 GGUF file, the architecture written)."""
    job = converted[request.param]
    return request.param, job.folder, job.outputs["f32"], CASES[request.param][1]


def test_the_file_is_llama_cpps(case):
    _, _, path, arch = case
    arch_field = gguf.GGUFReader(path).fields["general.architecture"]
    assert arch_field.contents() == arch
    assert arch in ARCHITECTURES


@pytest.fixture(scope="module")
def loaded(case):
    """(the F32 file loaded, the checkpoint loaded): float32, 64 positions, 2 rows."""
    _, folder, path, _ = case
    kw = dict(max_seq_len=64, max_batch_size=2, dtype="float32")  # the file's floats are F32
    return load_model(path, **kw), load_model(folder, **kw)


def test_f32_file_equals_the_checkpoint(case, loaded):
    name = case[0]
    ours, theirs = loaded
    model_type = LOADS_AS.get(name, theirs.config.model_type)
    assert ours.config == dataclasses.replace(theirs.config, model_type=model_type)
    check_same_outputs(ours, theirs)


def check_same_outputs(ours, theirs) -> None:
    """The file's model gives the checkpoint's logits (1e-4 relative) and greedy tokens."""
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    want, got = theirs.forward(x), ours.forward(x)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4
    prompt = x[0, :12].tolist()
    want_ids = theirs.generate(prompt, max_new_tokens=8).token_ids
    assert ours.generate(prompt, max_new_tokens=8).token_ids == want_ids


def test_tokenizer_and_chat_template_come_from_the_file(case, loaded):
    name, _, _, arch = case
    ours, theirs = loaded
    assert ours.tokenizer.encode(TEXT) == theirs.tokenizer.encode(TEXT)
    # byte-level BPEs: the pieces the regex splits TEXT into (the tiny BPE seldom merges across
    # two regexes' different splits, so equal ids alone would not tell them apart)
    if not arch.startswith("gemma") and TOKENIZERS.get(name) != "sentencepiece":
        pieces = [[p for p, _ in m.tokenizer._tok.pre_tokenizer.pre_tokenize_str(TEXT)]
                  for m in (ours, theirs)]  # fmt: skip
        assert pieces[0] == pieces[1]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    assert ours.tokenizer.apply_chat_template(chat) == theirs.tokenizer.apply_chat_template(chat)
    assert ours.tokenizer.eos_token_id == theirs.tokenizer.eos_token_id


def test_padding_rows_decode_to_nothing_as_in_the_checkpoint(loaded):
    """The embedding's rows past the tokenizer, which the converter names "[PAD{id}]" (type
    UNUSED): an answer that samples one shows nothing, as from the checkpoint and llama.cpp,
    not the letters of that name."""
    ours, theirs = loaded
    ids = [40, VOCAB - 1, 41]
    assert ours.tokenizer.decode(ids) == theirs.tokenizer.decode(ids)
    assert "PAD" not in ours.tokenizer.decode(ids)


def test_q8_0_file_kept_meets_the_standard(case):
    """llama.cpp's converter writes the linear weights as Q8_0 blocks; Zoo keeps them as
    stored and is judged as llama.cpp judges a quantization: against the same file
    dequantized, teacher-forced. Dequantized, each weight is the F32 file's to within Q8_0's
    rounding (half a step, the step 1/127 of a block's largest value, in fp16; here bounded by
    the tensor's largest / 200)."""
    name, _, f32_path, _ = case
    path = f32_path.with_name("q8_0.gguf")  # converted with the F32 file (the `case` fixture)
    kept = load_model(path, max_seq_len=128, max_batch_size=2)
    floats = load_model(path, max_seq_len=128, max_batch_size=2, dequantize=True)
    assert "q8_0" in weight_formats(kept.net)
    # routed experts stay in their stacked blocks too (only the chosen ones are read); where
    # the converter could write them in blocks (rows of a multiple of 32: qwen3moe's all)
    stacked = [m.weight for m in kept.net.modules() if isinstance(m, StackedLinear)]
    assert any(isinstance(w, BlockExperts) for w in stacked) == bool(stacked)
    if name == "qwen3moe":
        assert all(isinstance(w, BlockExperts) for w in stacked)
    if name == "gpt-oss-mxfp4":  # the converter keeps MXFP4 experts as they are
        assert {w.fmt.name for w in stacked if isinstance(w, BlockExperts)} == {"mxfp4"}
    # and every architecture decodes on the fused CPU step, as the modules do (MoE of every
    # routing, MLA, post-norms, DeltaNet and Mamba2 layers with fp16 conv windows, MXFP4
    # experts, Nemotron-H's one-mixer layers and relu2 experts)
    assert why_not(kept.net) is None
    _fused_step_as_the_modules(kept, floats)
    x = torch.randint(0, VOCAB, (1, 120), generator=torch.Generator().manual_seed(1))
    top1, kl = judge(kept.forward(x)[0].float(), floats.forward(x)[0].float())
    assert top1 >= 0.99 and kl <= 1e-3
    got = load_model(path, max_seq_len=8, dequantize=True, dtype="float32").net.named_parameters()
    f32 = load_model(f32_path, max_seq_len=8, dtype="float32", dequantize=True)  # MXFP4 too
    want = dict(f32.net.named_parameters())
    for param, w in got:
        assert (w - want[param]).abs().max() <= want[param].abs().max() / 200, param


def _fused_step_as_the_modules(kept, floats) -> None:
    """The fused CPU step's decode logits against the modules', on the kept Q8_0 weights."""
    # Both round the Q8_0 products' 8-bit activations and the fp16 cache (kept weights' default)
    # alike, but a value an ulp apart in one meets another rounding step in the next product;
    # a model that amplifies such steps (Gemma 2's post-norms scale small outputs up) amplifies
    # the quantization's own error too: bounded by half of what the kept weights move the logits
    # from the dequantized floats (measured: 1/10-1/4; a wrong scale or row: their own size)
    tokens = feed(5)
    fused, modules = decode(kept, True, tokens), decode(kept, False, tokens)
    for got, want, ref in zip(fused, modules, decode(floats, False, tokens), strict=True):
        assert rel_err(got, want) < max(5e-4, rel_err(want, ref) / 2)


@pytest.mark.parametrize("case", ["gpt-oss-mxfp4"], indirect=True)
def test_mxfp4_experts_are_kept_as_the_blocks_read_gives(case):
    """gpt-oss's MXFP4 experts (ggml's block_mxfp4, the gate and up rows interleaved as the
    hub's) dequantize to the weights `read` gives, and on CPUs stay those blocks: the kept
    model's experts dequantize to the same floats, bit for bit; so does the `QuantExperts`
    that GPUs keep (`read_quantized`)."""
    from gguf.quants import dequantize

    ckpt = GGUFCheckpoint(case[2])
    name = "model.layers.1.mlp.experts.gate_up_proj_blocks"
    kind, raw, order = ckpt.blocks(name)
    assert (kind, order, ckpt.quant_format(name)) == ("mxfp4", None, "mxfp4")
    want = ckpt.read(name)
    assert want.shape == ckpt.shape(name) == (4, 64, 64)
    assert torch.equal(torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType.MXFP4)), want)
    gpu = ckpt.read_quantized(name)
    assert isinstance(gpu, QuantExperts) and gpu.fmt.name == "mxfp4" and gpu.shape == want.shape
    assert torch.equal(gpu.dequantize().view(torch.int32), want.view(torch.int32))
    kept = load_model(case[2], max_seq_len=16).net.model.layers[1].mlp.experts.gate_up_proj
    assert isinstance(kept.weight, BlockExperts) and kept.weight.fmt.name == "mxfp4"
    assert torch.equal(torch.stack([kept.weight.dequantize(e) for e in range(4)]), want)


def rewritten(path: Path, out: Path, edit) -> Path:
    """A copy at `out` of the F32 file `path`, its metadata (key -> value) and tensors (name ->
    array, in order) changed by `edit(arch, values, tensors)` in place."""
    reader = gguf.GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch = fields.pop("general.architecture").contents()
    values = {k: f.contents() for k, f in fields.items()}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    tensors = {t.name: t.data for t in reader.tensors}
    edit(arch, values, tensors)
    writer = gguf.GGUFWriter(out, arch)
    for k, value in values.items():
        kind, *sub = fields[k].types
        writer.add_key_value(k, value, kind, sub_type=sub[0] if sub else None)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def older_deepseek2(arch: str, values: dict, tensors: dict) -> None:
    """A deepseek2 file as llama.cpp's converter wrote it before it split MLA's kv_b_proj into
    attn_k_b / attn_v_b (2025): one `attn_kv_b` per layer (the hub's tensor as it is), the
    per-head sizes in key_length / value_length (no *_length_mla keys), kv heads = heads."""
    key = f"{arch}.attention."
    values[key + "key_length"] = values.pop(key + "key_length_mla")
    values[key + "value_length"] = values.pop(key + "value_length_mla")
    values[key + "head_count_kv"] = values[key + "head_count"]
    for name in [n for n in tensors if ".attn_k_b." in n]:
        # (heads, rank, nope) and (heads, v, rank) -> per head its k rows, then its v rows
        k_b, v_b = tensors.pop(name), tensors.pop(name.replace("attn_k_b", "attn_v_b"))
        kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
        tensors[name.replace("attn_k_b", "attn_kv_b")] = kv_b.reshape(-1, k_b.shape[1])


@pytest.mark.parametrize("case", ["deepseek2-v2-lite", "deepseek2-v3"], indirect=True)
def test_deepseek2_file_of_older_converters_loads_the_same(case, tmp_path):
    _, folder, path, _ = case
    older = rewritten(path, tmp_path / "older.gguf", older_deepseek2)
    stored = {t.name: t.data for t in gguf.GGUFReader(older).tensors}
    assert not any(".attn_k_b." in n for n in stored)
    hub = load_file(folder / "model.safetensors")
    for i in range(3):  # the rewrite is the hub's kv_b_proj, as older converters stored it
        want = hub[f"model.layers.{i}.self_attn.kv_b_proj.weight"].numpy()
        assert np.array_equal(stored[f"blk.{i}.attn_kv_b.weight"], want)
    assert_loads_the_same(path, older)


def assert_loads_the_same(a: Path, b: Path) -> None:
    """Two files of one checkpoint (a rewrite of `a` as another converter wrote it) load to the
    same config and to logits equal bit for bit."""
    kw = dict(max_seq_len=64, max_batch_size=2)
    first, second = load_model(a, **kw), load_model(b, **kw)
    assert second.config == first.config
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(second.forward(x), first.forward(x))


@pytest.mark.parametrize("case", ["deepseek2-v2-lite"], indirect=True)
def test_deepseek2_half_of_a_split_kv_b_is_named(case, tmp_path):
    def drop(arch, values, tensors):
        del tensors["blk.1.attn_v_b.weight"]

    path = rewritten(case[2], tmp_path / "broken.gguf", drop)
    with pytest.raises(
        CheckpointError, match=r"'blk\.1\.attn_k_b\.weight'.*'blk\.1\.attn_v_b\.weight'"
    ):
        load_model(path, max_seq_len=16)


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


def longrope_file(path, attn_factor: float, short: bool = True):
    """A phi3 file's LongRoPE part: the lengths 64 / 16, the factors, the attention factor."""
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(64)
    w.add_rope_scaling_orig_ctx_len(16)
    w.add_rope_scaling_attn_factors(attn_factor)
    w.add_tensor("rope_factors_long.weight", torch.full((4,), 2.0).numpy())
    if short:
        w.add_tensor("rope_factors_short.weight", torch.full((4,), 1.5).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_longrope_attention_factor_kept_only_where_the_lengths_do_not_imply_it(tmp_path):
    """The converter writes sqrt(1 + ln 4 / ln 16) for 64 / 16 positions, what the hub config
    implies (not written back); an early Phi-3 "yarn" config's 0.1 ln 4 + 1 is written back."""
    implied, yarn = (1 + math.log(4) / math.log(16)) ** 0.5, 0.1 * math.log(4) + 1
    rope = GGUFCheckpoint(longrope_file(tmp_path / "a.gguf", implied)).config()["rope_scaling"]
    assert rope == {
        "rope_type": "longrope",
        "long_factor": [2.0] * 4,
        "short_factor": [1.5] * 4,
        "original_max_position_embeddings": 16,
    }
    rope = GGUFCheckpoint(longrope_file(tmp_path / "b.gguf", yarn)).config()["rope_scaling"]
    assert rope["attention_factor"] == pytest.approx(yarn, rel=1e-6)
    with pytest.raises(CheckpointError, match="rope_factors_short"):
        GGUFCheckpoint(longrope_file(tmp_path / "c.gguf", implied, short=False)).config()


@pytest.mark.parametrize("case", ["glm4moe"], indirect=True)
def test_glm4moe_file_without_its_mtp_layer(case, loaded, tmp_path):
    """GLM converted with `--no-mtp` (no nextn_predict_layers, no MTP block) loads to the same
    model, declaring no MTP layer; the file with it holds its block as mtp.* names."""
    _, folder, path, _ = case
    assert GGUFCheckpoint(path).config()["num_nextn_predict_layers"] == 1
    assert any(n.startswith("mtp.blk.3.") for n in GGUFCheckpoint(path).tensor_names())
    short = convert(folder, tmp_path / "no_mtp.gguf", flags=("--no-mtp",))
    m = load_model(short, max_seq_len=64, max_batch_size=2, dtype="float32")
    assert m.config.mtp_layers == 0 and m.config.num_layers == 3
    x = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    assert rel_err(m.forward(x), loaded[1].forward(x)) <= 1e-4
