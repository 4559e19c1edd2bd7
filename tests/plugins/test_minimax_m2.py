"""MiniMax M2 (`minimax_m2`) parity against transformers on tiny random checkpoints (fp32).

q and k RMS-normed over all heads at once, rope on `rotary_dim` of each head's dims, every
layer a MoE routed by sigmoid scores plus a non-zero correction bias, renormalised. Two layouts:
the hub's (`block_sparse_moe.experts.E.w1`, the bias beside the gate, MiniMax's own config keys,
an MTP module after the decoder's layers) and transformers 5's in-memory one (experts stacked,
`mlp.e_score_correction_bias`).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hub_style, randomize, save_in_memory_names
from fixtures.fused_steps import decode, feed
from parity import ParitySuite, ids, rel_err
from safetensors.torch import load_file, save_file

from core import CheckpointError, ConfigError, load_model
from core.cpu_step import why_not
from core.parallel.tp import check
from plugins.minimax_m2 import MiniMaxM2Config

VOCAB = 128
MINIMAX_M2 = dict(
    model_type="minimax_m2",
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=24,  # each expert's width
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rotary_dim=8,  # half of each head rotates
    num_local_experts=8,
    num_experts_per_tok=3,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)
# what MiniMax's released config.json spells out beside transformers' keys
HUB_KEYS = dict(use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid",
                use_routing_bias=True, shared_intermediate_size=0, attn_type_list=[1, 1],
                use_mtp=True, num_mtp_modules=1, mtp_transformer_layers=1)  # fmt: skip
CASES = ("hub", "stacked")


def make_minimax(root, layout: str = "hub", spec: dict = MINIMAX_M2, mtp: bool = True, **hub):
    """Save a random transformers MiniMax M2 under root in `layout` (the hub's: with an MTP
    module unless not `mtp`); `hub` overrides config.json keys. Returns (folder, transformers
    model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec), dtype=torch.float32)
    ref.eval()
    randomize(ref)
    g = torch.Generator().manual_seed(7)
    for layer in ref.model.layers:  # a buffer, which randomize() leaves at zero
        layer.mlp.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
    ref.save_pretrained(root)
    path = root / "config.json"
    cfg = json.loads(path.read_text())
    if layout == "stacked":  # transformers 5's names, its own config.json
        assert "model.layers.0.mlp.e_score_correction_bias" in save_in_memory_names(root, ref)
    else:
        cfg = {**hub_style(cfg), **HUB_KEYS, "use_mtp": mtp}
        if mtp:
            add_mtp_module(root, spec["num_hidden_layers"])
    path.write_text(json.dumps({**cfg, **hub}))
    return root, ref


def add_mtp_module(root, n: int) -> None:
    """An MTP module as layer n: a copy of the last layer (the hub's names)."""
    path = root / "model.safetensors"
    out = load_file(path)
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in out
    last = f"model.layers.{n - 1}."
    mtp = {k.replace(last, f"model.layers.{n}."): v.clone() for k, v in out.items() if last in k}
    out.update(mtp)
    save_file({k: v.contiguous() for k, v in out.items()}, path, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=CASES)
def minimax(request, tmp_path_factory):
    """(loaded model, transformers reference) per layout, built once per module."""
    root, ref = make_minimax(tmp_path_factory.mktemp(request.param), request.param)
    return load_model(root, max_seq_len=64, max_batch_size=2), ref


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on this module's models."""

    vocab = VOCAB

    @pytest.fixture
    def model(self, minimax):
        return minimax


@torch.no_grad()
def test_each_feature_moves_the_logits(minimax):
    """Zeroing the correction bias or the router, or making the all-heads q/k norm weights
    one per head (each head's copy of head 0's), moves the logits past the parity bar."""
    m, ref = minimax
    attn, gate = m.net.model.layers[0].self_attn, m.net.model.layers[0].mlp.gate
    assert attn.q_norm.weight.shape == (4 * 16,) and attn.k_norm.weight.shape == (2 * 16,)
    x = ids(VOCAB, 1, 12)
    for param, value in ((gate.e_score_correction_bias, 0.0), (gate.weight, 0.0),
                         (attn.k_norm.weight, attn.k_norm.weight[:16].repeat(2))):  # fmt: skip
        saved = param.detach().clone()
        param.copy_(torch.as_tensor(value).expand_as(param))
        try:
            m.reset()
            assert rel_err(m.forward(x), ref(x).logits) > 1e-3
        finally:
            param.copy_(saved)


@torch.no_grad()
def test_fused_cpu_step_norms_over_all_heads(minimax):
    """The mean square runs over all of q's heads (per head, the weights as loaded, q moves);
    the fused CPU decode step norms so too: ragged rows decoded through it equal the modules'
    (and the parity suite's greedy and ragged checks, which it runs, equal transformers')."""
    m, _ = minimax
    assert why_not(m.net) is None
    q_norm = m.net.model.layers[0].self_attn.q_norm
    q = torch.randn(1, 3, 64)
    per_head = q.view(1, 3, 4, 16)
    per_head = per_head * per_head.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
    assert not torch.allclose(q_norm(q), per_head.view(1, 3, 64) * q_norm.weight, atol=1e-3)
    tokens = feed()
    for got, want in zip(decode(m, True, tokens), decode(m, False, tokens), strict=True):
        assert rel_err(got, want) < 1e-5


def test_rotary_dim_is_read(tmp_path):
    """rotary_dim 8 of head_dim 16; rope on every dim instead moves the logits."""
    root, ref = make_minimax(tmp_path, rotary_dim=16)
    m = load_model(root, max_seq_len=32)
    assert m.config.rope.dim == 16 and not m.config.rope.interleaved
    x = ids(VOCAB, 1, 16)
    with torch.no_grad():
        assert rel_err(m.forward(x), ref(x).logits) > 1e-3


def test_config_spec():
    raw = {**MINIMAX_M2, **HUB_KEYS}
    cfg = MiniMaxM2Config.from_dict(raw).to_runtime()
    a, moe = cfg.attention, cfg.moe
    assert a.qk_norm_all_heads and a.qk_norm is not None and not a.qkv_bias
    assert cfg.rope.dim == 8 and cfg.mtp_layers == 1
    assert moe.layers == (0, 1) and moe.shared_width == 0
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 3, 24)
    assert (moe.scoring, moe.topk_method, moe.num_groups, moe.norm_topk_prob) == (
        "sigmoid", "noaux_tc", 1, True)  # fmt: skip
    # a partial_rotary_factor wins over rotary_dim (transformers' setdefault); no MTP unless use_mtp
    cfg = MiniMaxM2Config.from_dict(dict(raw, partial_rotary_factor=0.25, use_mtp=False))
    assert cfg.to_runtime().rope.dim == 4 and cfg.to_runtime().mtp_layers == 0
    with pytest.raises(ConfigError, match="q/k norm over all heads"):
        check(MiniMaxM2Config.from_dict(raw).to_runtime(), 2, "config.json")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"attn_type_list": [1, 0]}, "attn_type_list"),
        ({"qk_norm_type": "per_head"}, "qk_norm_type"),
        ({"use_qk_norm": False}, "use_qk_norm"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"shared_intermediate_size": 64}, "shared_intermediate_size"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"rotary_dim": 3}, "partial_rotary_factor"),
    ],
)
def test_bad_configs_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        MiniMaxM2Config.from_dict({**MINIMAX_M2, **HUB_KEYS, **changes}).to_runtime()


def test_mtp_module_skipped_only_when_declared(tmp_path):
    root, _ = make_minimax(tmp_path / "a", use_mtp=False)  # layer 2 is unexplained
    with pytest.raises(CheckpointError, match=r"unexpected \(model\.layers\.2\."):
        load_model(root, max_seq_len=16)
    # as released: 3 MTP modules declared, none in the weights
    root, _ = make_minimax(tmp_path / "b", mtp=False, use_mtp=True, num_mtp_modules=3)
    assert load_model(root, max_seq_len=16).config.mtp_layers == 3


def test_registry_shape_is_minimax_m2():
    """registry.yaml's `minimax-m2` shape reads as MiniMax's: 62 MoE layers, half-rotated heads
    of 128, q/k norms over all heads, 3 MTP modules skipped (tests/core/test_registry_shapes.py
    checks its parameter count, 228.7B: 230B on the card)."""
    from core.hub import named_models

    entry = named_models()["minimax-m2"]
    assert entry["repo"] == "MiniMaxAI/MiniMax-M2"
    cfg = MiniMaxM2Config.from_dict(entry["shape"]).to_runtime()
    assert cfg.rope.dim == 64 and cfg.mtp_layers == 3 and cfg.moe.layers == tuple(range(62))
    assert cfg.attention.qk_norm_all_heads and cfg.moe.top_k == 8


@torch.no_grad()
def test_block_fp8_checkpoint_as_released(tmp_path):
    """MiniMax's own weights are block fp8 with `fmt: float8_e4m3fn` (the router, its bias and
    the head left out): the fp8 folder loads to the logits of the same weights dequantized."""
    from test_fp8 import dequantize, quantize

    root, _ = make_minimax(tmp_path / "fp8", mtp=False)
    path, block = root / "model.safetensors", (16, 16)
    state = load_file(path)
    deq = dict(state)
    for name in [n for n in state if n.endswith(("_proj.weight", ".w1.weight", ".w2.weight",
                                                  ".w3.weight"))]:  # fmt: skip
        fp8, scale = quantize(state[name], block)
        state[name], state[name + "_scale_inv"] = fp8, scale
        deq[name] = dequantize(fp8, scale, block)
    save_file(state, path, metadata={"format": "pt"})
    floats = tmp_path / "floats"
    floats.mkdir()
    save_file(deq, floats / "model.safetensors", metadata={"format": "pt"})
    (floats / "config.json").write_text((root / "config.json").read_text())
    qc = dict(quant_method="fp8", fmt="float8_e4m3fn", activation_scheme="dynamic",
              weight_block_size=list(block),
              modules_to_not_convert=["gate", "e_score_correction_bias", "lm_head"])  # fmt: skip
    cfg = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    x = ids(VOCAB, 1, 12)
    want = load_model(floats, max_seq_len=16).forward(x)
    assert rel_err(load_model(root, max_seq_len=16).forward(x), want) < 1e-5
