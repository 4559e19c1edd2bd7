"""Quantizing at load (`quantize="int8"|"int4"`): which weights become `QuantWeight`s, that the
model computes exactly what floats holding the dequantized values would, and how close it stays
to the unquantized transformers reference."""

from __future__ import annotations

import pytest
import torch
from conftest import LLAMA31, LLAMA32
from test_deepseek import make_deepseek

from core import RequestError, load_model
from core.quantize import weight_formats
from kernels.qweight import QuantWeight

# hidden 64: rows split into groups of 32; intermediate 80 does not, so down_proj stays float
SPEC = dict(LLAMA31, hidden_size=64, intermediate_size=80)


def rel_err(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def as_floats(quantized, root):
    """The float model with every quantized weight replaced by its dequantized values."""
    floats = load_model(root, max_seq_len=64, max_batch_size=2)
    params = dict(floats.net.named_parameters())
    for name, m in quantized.net.named_modules():
        if isinstance(m, QuantWeight):
            params[name].data.copy_(m.dequantize())
    return floats


# measured: int8 0.038-0.040, int4 0.50-0.57 (random weights scaled up so that errors show)
@pytest.mark.parametrize(("kind", "error"), [("int8", 0.08), ("int4", 0.8)])
@pytest.mark.parametrize("spec", [SPEC, dict(LLAMA32, hidden_size=64)], ids=["untied", "tied"])
def test_quantized_at_load(checkpoint, kind, error, spec):
    root, ref = checkpoint(spec)
    m = load_model(root, max_seq_len=64, max_batch_size=2, quantize=kind)
    net = m.net
    block = net.model.layers[0]
    assert isinstance(block.self_attn.qkv_proj.weight, QuantWeight)
    assert isinstance(net.model.embed_tokens.weight, QuantWeight)
    # groups of 32 columns: down_proj's 80 do not split, so it stays in float
    assert not isinstance(block.mlp.down_proj.weight, QuantWeight)
    assert set(weight_formats(net)) == {kind, "float32"}
    x = torch.randint(4, spec["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    got = m.forward(x)
    # exactly the function of the dequantized weights, to fp32 rounding
    assert rel_err(got, as_floats(m, root).forward(x)) < 1e-5
    # and near the unquantized model
    assert rel_err(got, ref(x).logits) < error


def test_mla_kv_b_proj_stays_float(tmp_path):
    root, _ = make_deepseek(tmp_path, "v2-lite")
    m = load_model(root, max_seq_len=16, quantize="int8")
    attn = m.net.model.layers[0].self_attn
    assert isinstance(attn.kv_a_proj_with_mqa.weight, QuantWeight)
    assert not isinstance(attn.kv_b_proj.weight, QuantWeight)  # read as a matrix
    x = torch.randint(4, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    assert rel_err(m.forward(x), as_floats(m, root).forward(x)) < 1e-5


def test_bad_quantize_is_named(checkpoint):
    root, _ = checkpoint(SPEC)
    with pytest.raises(RequestError, match="quantize='int3' is not one of int8, int4"):
        load_model(root, quantize="int3")
