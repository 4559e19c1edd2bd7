"""Quantizing at load (`quantize="int8"|"int4"`): which weights are quantized (on CPUs they
become GGML Q8_0 / Q4_1 `BlockWeight`s), that the model computes what floats holding the
dequantized values would (to the 15-bit rounding of x the block products make), and how close
it stays to the unquantized transformers reference."""

from __future__ import annotations

import pytest
import torch
from conftest import LLAMA31, LLAMA32
from test_deepseek import make_deepseek

from core import RequestError, load_model
from core.quantize import weight_formats
from kernels.blocks import BlockWeight
from kernels.qweight import QuantWeight

QUANTIZED = QuantWeight | BlockWeight

# hidden 64: rows split into groups of 32; intermediate 80 does not, so down_proj stays float
SPEC = dict(LLAMA31, hidden_size=64, intermediate_size=80)


def rel_err(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def as_floats(quantized, root):
    """The float model with every quantized weight replaced by its dequantized values."""
    floats = load_model(root, max_seq_len=64, max_batch_size=2)
    params = dict(floats.net.named_parameters())
    for name, m in quantized.net.named_modules():
        if isinstance(m, QUANTIZED):
            params[name].data.copy_(m.dequantize())
    return floats


# measured: int8 0.038-0.040, int4 0.50-0.57 (random weights scaled up so that errors show)
@pytest.mark.parametrize(("kind", "error"), [("int8", 0.08), ("int4", 0.8)])
@pytest.mark.parametrize("spec", [SPEC, dict(LLAMA32, hidden_size=64)], ids=["untied", "tied"])
def test_quantized_at_load(checkpoint, kind, error, spec):
    root, ref = checkpoint(spec)
    # the cache in fp32 (quantized weights' default on CPUs is fp16): only the weights differ
    m = load_model(root, max_seq_len=64, max_batch_size=2, quantize=kind, kv_dtype="float32")
    net = m.net
    block = net.model.layers[0]
    qkv = block.self_attn.qkv_proj.weight
    assert isinstance(qkv, BlockWeight) and qkv.fmt.name == {"int8": "q8_0", "int4": "q4_1"}[kind]
    assert isinstance(net.model.embed_tokens.weight, BlockWeight)
    # groups of 32 columns: down_proj's 80 do not split, so it stays in float
    assert not isinstance(block.mlp.down_proj.weight, QUANTIZED)
    assert set(weight_formats(net)) == {qkv.fmt.name, "float32"}
    x = torch.randint(4, spec["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    got = m.forward(x)
    # the function of the dequantized weights, but for x's rounding to 15 bits in each block
    # product: half a step, 2^-16 of its block's largest value, which here is up to 6x the
    # block's mean (2-3e-5 per product over 64 columns); measured 1.9e-4 at the logits
    assert rel_err(got, as_floats(m, root).forward(x)) < 5e-4
    # and near the unquantized model
    assert rel_err(got, ref(x).logits) < error


def test_mla_kv_b_proj_stays_float(tmp_path):
    root, _ = make_deepseek(tmp_path, "v2-lite")
    m = load_model(root, max_seq_len=16, quantize="int8", kv_dtype="float32")
    attn = m.net.model.layers[0].self_attn
    assert isinstance(attn.kv_a_proj_with_mqa.weight, BlockWeight)
    assert not isinstance(attn.kv_b_proj.weight, QUANTIZED)  # read as a matrix
    x = torch.randint(4, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    # x's 15-bit rounding in each block product, as above (measured 1.4e-4)
    assert rel_err(m.forward(x), as_floats(m, root).forward(x)) < 5e-4


def test_bad_quantize_is_named(checkpoint):
    root, _ = checkpoint(SPEC)
    with pytest.raises(RequestError, match="quantize='int3' is not one of int8, int4"):
        load_model(root, quantize="int3")
