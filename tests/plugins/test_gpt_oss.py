"""gpt-oss parity against transformers on tiny random checkpoints (fp32).

Window 6 on the even layers (shorter than the test sequences), full attention on the odd ones,
non-zero sinks scaled up, q/k/v/o biases, YaRN with truncate false, router and expert biases,
a clamp limit that bites (1.5: most gate/up values pass it), the interleaved gate_up tensor
stored as transformers saves it ((E, H, 2I)), and an MXFP4 checkpoint (blocks + e8m0 scales,
as released) checked against transformers' own MXFP4 dequantization.
"""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch
from conftest import make_checkpoint, save_in_memory_names
from fixtures.texts import judge
from parity import (
    ParitySuite,
    check_greedy,
    check_prefill,
    ids,
    rel_err,
)
from safetensors.torch import load_file, save_file

from core import ConfigError, load_model, quantize
from core.quantize import weight_formats
from kernels import blocks, dispatch
from kernels.blocks import BlockExperts
from kernels.qweight import QuantExperts
from plugins.gpt_oss import GptOssConfig

GPT_OSS = dict(
    model_type="gpt_oss",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=6,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    swiglu_limit=1.5,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_parameters=dict(
        rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
        truncate=False, original_max_position_embeddings=32,
    ),
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)  # fmt: skip
VOCAB = GPT_OSS["vocab_size"]


def make_gpt_oss(root, spec: dict = GPT_OSS):
    root, ref = make_checkpoint(root, spec)
    with torch.no_grad():  # sinks large enough to move the softmax visibly
        for layer in ref.model.layers:
            layer.self_attn.sinks.mul_(10)
    state = save_in_memory_names(root, ref)  # the scaled sinks; experts as transformers holds them
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)  # (E, H, 2I)
    return root, ref


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    root, ref = make_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))
    return load_model(root, max_seq_len=64, max_batch_size=2), ref


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on this module's models."""

    vocab = VOCAB
    prefill_len = 40
    decode = (20, 13)
    greedy_len = 15
    ragged: ClassVar[dict] = dict(lengths=(4, 16), steps=3, new=8)

    @pytest.fixture
    def model(self, gpt_oss):
        return gpt_oss


def test_runtime_config_follows_the_hub_keys(gpt_oss):
    m, _ = gpt_oss
    cfg = m.config
    assert [a.window for a in cfg.attention_layers] == [6, None, 6]
    assert all(a.sinks and a.qkv_bias and a.o_bias for a in cfg.attention_layers)
    assert cfg.rope.truncate is False and cfg.rope.factor == 4.0
    assert cfg.moe.bias and cfg.moe.glu.limit == 1.5 and cfg.moe.glu.alpha == 1.702


def test_defaults_are_transformers(tmp_path):
    """No layer_types / rope keys: even layers slide by 128, YaRN 32x from 4096, untruncated."""
    from transformers import GptOssConfig as HF

    hf = HF()
    raw = dict(model_type="gpt_oss", vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
               num_hidden_layers=4, num_attention_heads=hf.num_attention_heads,
               intermediate_size=hf.intermediate_size)  # fmt: skip
    cfg = GptOssConfig.from_dict(raw).to_runtime()
    windows = [a.window for a in cfg.attention_layers]
    assert windows == [hf.sliding_window, None, hf.sliding_window, None]
    assert (cfg.rope.theta, cfg.rope.factor, cfg.rope.truncate) == (150000.0, 32.0, False)
    assert cfg.rope.original_max_position_embeddings == 4096
    assert cfg.attention.head_dim == hf.head_dim and cfg.attention.num_kv_heads == 8
    assert (cfg.moe.num_experts, cfg.moe.top_k) == (hf.num_local_experts, hf.num_experts_per_tok)
    assert (cfg.moe.glu.alpha, cfg.moe.glu.limit) == (hf.swiglu_alpha, hf.swiglu_limit)


def test_bad_config_names_the_field():
    raw = dict(GPT_OSS)
    del raw["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        GptOssConfig.from_dict(raw)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        GptOssConfig.from_dict(dict(GPT_OSS, num_experts_per_tok=5)).to_runtime()
    with pytest.raises(ConfigError, match="swiglu_limit"):
        GptOssConfig.from_dict(dict(GPT_OSS, swiglu_limit=-1))


# --- MXFP4 ---------------------------------------------------------------------------------
def _pack(rng: torch.Generator, shape: tuple[int, ...]):
    """Random MXFP4 blocks (..., G, 16) uint8 and e8m0 scales (..., G) uint8 for an
    (..., G * 32) weight; exponents 2^-3 .. 2^0 keep the model's activations moderate."""
    *lead, cols = shape
    blocks = torch.randint(0, 256, (*lead, cols // 32, 16), generator=rng, dtype=torch.uint8)
    scales = torch.randint(124, 128, (*lead, cols // 32), generator=rng, dtype=torch.uint8)
    return blocks, scales


def to_mxfp4(root, seed: int = 5) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Rewrite a saved gpt-oss folder as the released checkpoints store it: each layer's experts
    as random MXFP4 `_blocks` + `_scales` in the (E, out, in) orientation, config.json with
    quantization_config {quant_method: mxfp4}. Returns {stacked name: (blocks, scales)}."""
    state = load_file(root / "model.safetensors")
    rng = torch.Generator().manual_seed(seed)
    packed = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, cols, rows = state.pop(name).shape  # stored (E, in, out), as transformers holds it
        packed[name] = _pack(rng, (e, rows, cols))  # (E, out, in / 32, 16)
        state[f"{name}_blocks"], state[f"{name}_scales"] = packed[name]
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((root / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (root / "config.json").write_text(json.dumps(cfg))
    return packed


@torch.no_grad()
def mxfp4_checkpoint(tmp_path):
    """(folder, reference): experts stored as the released checkpoints store them: `_blocks` +
    `_scales` in the (E, out, in) orientation, quantization_config {quant_method: mxfp4}. The
    reference model takes transformers' own dequantization of the same bytes
    (convert_moe_packed_tensors)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    spec = dict(GPT_OSS, hidden_size=64, intermediate_size=32)
    root, ref = make_gpt_oss(tmp_path, spec)
    packed = to_mxfp4(root)
    for i, layer in enumerate(ref.model.layers):
        ex, key = layer.mlp.experts, f"model.layers.{i}.mlp.experts"
        for name in ("gate_up_proj", "down_proj"):
            w = convert_moe_packed_tensors(*packed[f"{key}.{name}"], dtype=torch.float32)
            getattr(ex, name).copy_(w)
    return root, ref


@torch.no_grad()
def test_mxfp4_checkpoint_matches_transformers_dequantized(tmp_path):
    """dequantize=True (what GPUs do): transformers' floats, bit for bit."""
    root, ref = mxfp4_checkpoint(tmp_path)
    m = load_model(root, max_seq_len=64, max_batch_size=2, dequantize=True)
    want = ref.model.layers[1].mlp.experts.gate_up_proj.transpose(1, 2)
    assert torch.equal(m.net.model.layers[1].mlp.experts.gate_up_proj.weight, want)
    check_prefill(m, ref, ids(VOCAB, 2, 40))
    check_greedy(m, ref, ids(VOCAB, 1, 15, seed=3))
    # and the dequantized weights matter: a zeroed expert block moves the logits
    w = m.net.model.layers[0].mlp.experts.down_proj.weight
    saved = w.clone()
    w.zero_()
    m.reset()
    x = ids(VOCAB, 1, 12)
    assert rel_err(m.forward(x), ref(x).logits) > 1e-3
    w.copy_(saved)


@torch.no_grad()
def test_mxfp4_experts_are_kept_on_cpus(tmp_path):
    """On CPUs the experts stay MXFP4 (GGML's blocks of the same values: the bytes they were
    stored in) and meet the standard for kept weights against the same model dequantized
    (teacher-forced: top-1 >= 99%, mean KL <= 1e-3)."""
    root, ref = mxfp4_checkpoint(tmp_path)
    kept = load_model(root, max_seq_len=128)
    floats = load_model(root, max_seq_len=128, dequantize=True)
    experts = kept.net.model.layers[1].mlp.experts.gate_up_proj.weight
    assert isinstance(experts, BlockExperts) and experts.fmt.name == "mxfp4"
    want = floats.net.model.layers[1].mlp.experts.gate_up_proj.weight
    assert torch.equal(experts.dequantize(3), want[3])  # the same values, bit for bit
    stored = 4 * (64 * 2 * 17 + 64 * 17)  # per layer: E experts' blocks + scales
    # (repacked: each group of 16 rows' scale bytes padded to 64 bytes)
    assert weight_formats(kept.net)["mxfp4"][1] <= 1.2 * stored * len(ref.model.layers)
    x = ids(VOCAB, 1, 120, seed=4)
    top1, kl = judge(kept.forward(x)[0].float(), floats.forward(x)[0].float())
    assert top1 >= 0.99 and kl <= 1e-3


@pytest.mark.parametrize(
    "device,keep", [("cuda", True), ("cuda:1", True), ("cpu", None), ("meta", False)]
)
def test_where_mxfp4_is_kept(device, keep):
    """MXFP4 stays MXFP4 on CUDA GPUs (Triton's QuantWeight / QuantExperts: no capability
    needed, the codes are widened in registers) and on CPUs whose C kernels build; gpt-oss's
    stacked experts, biases and all, as one QuantExperts on GPUs, BlockExperts on CPUs."""
    from core.modeling import CausalLM

    device = torch.device(device)
    keep = blocks.available() if keep is None else keep
    assert quantize.keeps("mxfp4", device) is keep
    with torch.device("meta"):
        net = CausalLM(GptOssConfig.from_dict(GPT_OSS).to_runtime())
    target = "model.layers.0.mlp.experts.gate_up_proj.weight"
    assert quantize.stacked_experts(net, target, ["mxfp4"], device) is keep
    assert not quantize.stacked_experts(net, target, ["fp8_e4m3"], device)  # (biases)


@torch.no_grad()
def test_mxfp4_experts_are_kept_as_on_gpus(tmp_path, monkeypatch):
    """The loader's GPU path, here on the CPU (the C kernels made unavailable, the decisions
    answered as for a CUDA device): the experts become one `QuantExperts` each, 4.25 bits per
    weight (a code and an e8m0 byte per 32), dequantizing to the same floats as the checkpoint
    read dequantized; through the Triton kernels (the interpreter; the experts' MXFP4 grouped
    GEMMs with their biases and clamped SwiGLU) the model gives the dequantized model's
    logits (its torch reference's)."""
    root, _ = mxfp4_checkpoint(tmp_path)
    floats = load_model(root, max_seq_len=64, max_batch_size=2, dequantize=True)
    stacked = quantize.stacked_experts
    monkeypatch.setattr(blocks, "available", lambda: False)
    monkeypatch.setattr(quantize, "keeps", lambda fmt, device: fmt == "mxfp4")
    monkeypatch.setattr(quantize, "stacked_experts",
                        lambda *a: stacked(*a[:3], torch.device("cuda")))  # fmt: skip
    # (kept weights on CPUs default to an fp16 cache: fp32, as the float model's)
    kept = load_model(root, max_seq_len=64, max_batch_size=2, kv_dtype="float32")
    for i in range(len(kept.net.model.layers)):
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(kept.net.model.layers[i].mlp.experts, name).weight
            want = getattr(floats.net.model.layers[i].mlp.experts, name).weight
            assert isinstance(w, QuantExperts) and w.fmt.name == "mxfp4"
            assert torch.equal(w.dequantize(), want)  # (transformers' code 8: -0.0, equal)
    n, nbytes = weight_formats(kept.net)["mxfp4"]
    assert n == 3 * 4 * 3 * 32 * 64 and nbytes * 8 == 4.25 * n
    x = ids(VOCAB, 2, 24, seed=4)
    want = floats.forward(x)
    monkeypatch.setenv("ZOO_KERNELS", "triton")  # (raises rather than fall back)
    monkeypatch.setattr(dispatch, "_chosen", {})
    assert rel_err(kept.forward(x), want) < 1e-4  # every op in Triton: the parity bar
    assert "moe_experts" in {key[0] for key in dispatch._chosen}


def test_registry_shape_is_gpt_oss_20b():
    """registry.yaml's `gpt-oss-20b` shape builds (on the meta device) the published 20.9B
    model (OpenAI's model card: 21B parameters, 3.6B active)."""
    from core.hub import named_models
    from core.modeling import CausalLM

    entry = named_models()["gpt-oss-20b"]
    assert entry["repo"] == "openai/gpt-oss-20b"
    cfg = GptOssConfig.from_dict(entry["shape"]).to_runtime()
    assert [a.window for a in cfg.attention_layers[:2]] == [128, None]
    with torch.device("meta"):
        net = CausalLM(cfg)
    assert f"{sum(p.numel() for p in net.parameters()) / 1e9:.1f}B" == entry["params"] == "20.9B"
