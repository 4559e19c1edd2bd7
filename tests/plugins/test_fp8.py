"""DeepSeek-V3's own fp8 weights: a tiny V3 checkpoint whose linear weights the test converts to
float8_e4m3fn with 128 x 128 block scales (`weight_scale_inv`), as DeepSeek ships V3/R1, loads
and matches transformers running the same weights dequantized (fp32).

hidden_size 136 and intermediate_size 160 give weights of several blocks with partial edge
blocks ((160, 136): a 2 x 2 grid whose last row and column of blocks are 32 and 8 wide).
"""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from conftest import hub_style, randomize
from parity import check_greedy, check_prefill, ids, rel_err
from safetensors.torch import load_file, save_file
from test_deepseek import V3, V3_HUB, VOCAB, hub_config, hub_tensors, set_correction_bias

from core import CheckpointError, ConfigError, load_model
from plugins.formats.safetensors import SafetensorsCheckpoint

SPEC = dict(V3, hidden_size=136, intermediate_size=160)
FP8 = dict(
    quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128], activation_scheme="dynamic"
)
E4M3_MAX = 448.0


def quantize(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 weight_scale_inv): each block scaled so its largest |w| maps to 448."""
    (out, inp), (bn, bk) = w.shape, block
    fp8 = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(math.ceil(out / bn), math.ceil(inp / bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            scale[i, j] = blk.abs().amax().clamp_min(1e-12) / E4M3_MAX
            fp8[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (blk / scale[i, j]).to(fp8.dtype)
    return fp8, scale


def dequantize(fp8: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """The reference: every block's scale expanded over the whole matrix, then one product."""
    out, inp = fp8.shape
    s = scale.repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]
    return fp8.float() * s


def is_quantized(name: str) -> bool:
    """What DeepSeek-V3 stores in fp8: every projection; not embeddings, norms, router, head."""
    return name.endswith("_proj.weight")


def to_reference(ref, deq: dict[str, torch.Tensor]) -> None:
    """Put the dequantized weights (hub names, one tensor per expert) into transformers' model,
    whose experts may be stacked: experts.gate_up_proj (E, 2I, H), experts.down_proj (E, H, I)."""
    state, n = ref.state_dict(), ref.config.num_hidden_layers
    with torch.no_grad():
        for name, w in deq.items():
            if int(name.split(".")[2]) >= n:
                continue  # the MTP layer: Zoo skips it, transformers has none
            expert = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight", name)
            if name in state or expert is None:
                state[name].copy_(w)
                continue
            prefix, e, kind = expert[1], int(expert[2]), expert[3]
            stacked = state[f"{prefix}.{'down' if kind == 'down' else 'gate_up'}_proj"][e]
            rows = stacked.shape[0] // 2
            {"gate": stacked[:rows], "up": stacked[rows:], "down": stacked}[kind].copy_(w)


def make_fp8(root, block=(128, 128)):
    """A tiny V3 checkpoint (one MTP layer) in DeepSeek's fp8 layout; transformers' model holds
    the dequantized weights. Returns (folder, reference, {name: dequantized weight},
    {name: the float weight before quantization})."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(**SPEC), dtype=torch.float32)
    ref.eval()
    randomize(ref)
    set_correction_bias(ref)
    ref.save_pretrained(root)
    hub_tensors(root, ref, mtp_layers=1)
    cfg = hub_style(json.loads((root / "config.json").read_text()), rope_key="type")
    (root / "config.json").write_text(json.dumps(cfg))
    hub_config(root, num_nextn_predict_layers=1, **V3_HUB)
    hub_config(root, quantization_config=dict(FP8, weight_block_size=list(block)))
    state, deq = load_file(root / "model.safetensors"), {}
    orig = {n: w for n, w in state.items() if is_quantized(n)}
    for name in orig:
        fp8, scale = quantize(state[name], block)
        state[name], state[name + "_scale_inv"] = fp8, scale
        deq[name] = dequantize(fp8, scale, block)
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    to_reference(ref, deq)
    return root, ref, deq, orig


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return make_fp8(tmp_path_factory.mktemp("fp8"))


@pytest.fixture(scope="module")
def fp8_model(fp8_checkpoint):
    root, ref, *_ = fp8_checkpoint
    return load_model(root, max_seq_len=64, max_batch_size=2), ref


def test_checkpoint_has_edge_blocks_and_real_rounding(fp8_checkpoint):
    """The fixture covers what it claims: multi-block grids with partial edges, and fp8
    rounding large enough that the original floats would not pass the parity checks."""
    root, _, deq, orig = fp8_checkpoint
    state = load_file(root / "model.safetensors")
    scale = state["model.layers.0.mlp.gate_proj.weight_scale_inv"]
    assert state["model.layers.0.mlp.gate_proj.weight"].shape == (160, 136)
    assert scale.shape == (2, 2) and scale.unique().numel() == 4
    assert any(n.startswith("model.layers.3.") and n.endswith("_scale_inv") for n in state)  # MTP
    for name, w in orig.items():  # e4m3 keeps 3 mantissa bits: errors up to 1/16 of a value
        if w.any():  # the MTP layer's eh_proj is all zeros, and stays so
            assert rel_err(deq[name], w) > 1e-3, name


def test_reader_dequantizes_and_hides_the_scales(fp8_checkpoint):
    root, _, deq, _ = fp8_checkpoint
    ckpt = SafetensorsCheckpoint(root)
    names = ckpt.tensor_names()
    assert not [n for n in names if n.endswith("_scale_inv")]
    assert set(deq) <= set(names)
    for name, want in deq.items():
        got = ckpt.read(name)
        assert got.dtype == torch.float32 and ckpt.shape(name) == tuple(got.shape)
        assert torch.equal(got, want), name  # DeepSeek's weight_dequant: the same fp32 products
    assert ckpt.read("model.embed_tokens.weight").dtype == torch.float32  # floats untouched


def test_prefill_logits_match_dequantized_reference(fp8_model):
    m, ref = fp8_model
    check_prefill(m, ref, ids(VOCAB, 2, 40))


def test_greedy_tokens_identical(fp8_model):
    m, ref = fp8_model
    check_greedy(m, ref, ids(VOCAB, 1, 7, seed=3))


def test_bfloat16_weights_are_the_dequantized_ones_rounded(fp8_checkpoint):
    """dtype=bfloat16: fp32 products cast once, as DeepSeek's fp8 -> bf16 conversion does."""
    root, _, deq, _ = fp8_checkpoint
    m = load_model(root, dtype="bfloat16", max_seq_len=16)
    layer = m.net.model.layers[0]
    for got, name in [
        (layer.self_attn.q_a_proj.weight, "q_a_proj"),  # (32, 136): a 1 x 2 grid
        (layer.self_attn.o_proj.weight, "o_proj"),  # (136, 48): 2 x 1
    ]:
        want = deq[f"model.layers.0.self_attn.{name}.weight"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    assert torch.isfinite(m.forward(ids(VOCAB, 1, 5))).all()


@pytest.mark.parametrize("block", [(64, 48), (200, 32)])
def test_other_block_sizes_read_exactly(tmp_path, block):
    """weight_block_size is read from the config, rows and columns each their own."""
    root, _, deq, _ = make_fp8(tmp_path, block)
    ckpt = SafetensorsCheckpoint(root)
    for name, want in deq.items():
        assert torch.equal(ckpt.read(name), want), name


def test_bf16_scales_read_exactly(fp8_checkpoint, tmp_path):
    """Qwen3's -FP8 repos store weight_scale_inv in bf16: read as floats, products in fp32."""
    root = tmp_path / "bf16_scales"
    shutil.copytree(fp8_checkpoint[0], root)
    state = load_file(root / "model.safetensors")
    for name in [n for n in state if n.endswith("_scale_inv")]:
        state[name] = state[name].to(torch.bfloat16)
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    ckpt = SafetensorsCheckpoint(root)
    name = "model.layers.0.mlp.gate_proj.weight"
    want = dequantize(state[name], state[name + "_scale_inv"].float())
    assert torch.equal(ckpt.read(name), want)


# --- malformed fp8 checkpoints: the error names the tensor or field ----------------------------
W = "model.layers.0.self_attn.q_a_proj.weight"  # (32, 136): scales (1, 2)


def _drop_scale(state):
    del state[W + "_scale_inv"]


def _transpose_scale(state):
    state[W + "_scale_inv"] = state[W + "_scale_inv"].T.contiguous()


def _scale_for_float(state):
    state["model.norm.weight_scale_inv"] = torch.ones(1, 1)


def _e5m2_weight(state):
    state[W] = state[W].float().to(torch.float8_e5m2)


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (_drop_scale, CheckpointError, rf"'{W}' is fp8 but '{W}_scale_inv' is missing"),
        (_transpose_scale, CheckpointError, rf"'{W}_scale_inv' has shape \[2, 1\].*needs \[1, 2\]"),
        (_scale_for_float, CheckpointError, r"'model\.norm\.weight_scale_inv' scales no fp8"),
        (_e5m2_weight, CheckpointError, rf"'{W}' is F8_E5M2"),
    ],
)
def test_malformed_tensors_are_named(fp8_checkpoint, tmp_path, edit, error, match):
    root = tmp_path / "bad"
    shutil.copytree(fp8_checkpoint[0], root)
    state = load_file(root / "model.safetensors")
    edit(state)
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(error, match=match):
        load_model(root, max_seq_len=16)


@pytest.mark.parametrize(
    ("qc", "match"),
    [
        (dict(FP8, fmt="e5m2"), r"'quantization_config\.fmt' is 'e5m2'"),
        (dict(FP8, weight_block_size=[128]), r"'quantization_config\.weight_block_size'"),
        (dict(FP8, weight_block_size=[128, 0]), r"'quantization_config\.weight_block_size'"),
        ({"quant_method": "fp8"}, r"'quantization_config\.weight_block_size' is None"),
        (dict(FP8, activation_scheme="static"), r"'quantization_config\.activation_scheme'"),
        ({"quant_method": "gptq", "bits": 4}, r"'quantization_config' has quant_method 'gptq'"),
        ("fp8", r"'quantization_config' must be an object"),
    ],
)
def test_malformed_quantization_config_names_the_field(fp8_checkpoint, tmp_path, qc, match):
    root = tmp_path / "bad"
    shutil.copytree(fp8_checkpoint[0], root)
    hub_config(root, quantization_config=qc)
    with pytest.raises(ConfigError, match=match):
        load_model(root, max_seq_len=16)


def test_block_size_must_fit_the_scales(fp8_checkpoint, tmp_path):
    """Scales written for 128 x 128 blocks, config saying 64 x 64: every scale is named."""
    root = tmp_path / "bad"
    shutil.copytree(fp8_checkpoint[0], root)
    hub_config(root, quantization_config=dict(FP8, weight_block_size=[64, 64]))
    with pytest.raises(CheckpointError, match=r"fp8 tensor\(s\) do not fit .*\[64, 64\]"):
        load_model(root, max_seq_len=16)
