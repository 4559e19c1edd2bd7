"""LFM2 and LFM2-MoE against transformers (fp32) on tiny random checkpoints: gated short-conv
layers and attention layers with q/k layernorm, the MLP width derived from block_ff_dim, the
legacy keys real LFM2 configs carry, the conv state across chunked prefills, and LFM2-MoE's
sigmoid routing with an expert bias after a dense layer.

Every feature is sized to move transformers' logits: conv_bias on (its biases random), a
4-tap conv (conv_L_cache) and two conv layers per attention layer, and random q/k norms;
each switch-off test proves that switching it off in our config alone breaks parity.
"""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch
from conftest import make_checkpoint
from parity import TOL, ParitySuite, ids, rel_err

from core import ConfigError, load_model
from core.config import GQASpec
from core.config_kinds import ShortConvSpec
from core.cpu_step import kinds, why_not
from core.parallel import tp
from plugins.lfm2 import Lfm2Config

VOCAB = 96
LFM2 = dict(
    model_type="lfm2",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=96,  # auto-adjusted: int(2 * 96 / 3) = 64, x 1.5 = 96, up to 32: 96
    block_multiple_of=32,
    block_ffn_dim_multiplier=1.5,
    block_auto_adjust_ff_dim=True,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    layer_types=["conv", "full_attention", "conv"],
    conv_L_cache=4,
    conv_bias=True,
    norm_eps=1e-5,
    max_position_embeddings=256,
    rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# LFM2-MoE (LFM2-8B-A1B-style): a dense first layer, then 4 experts of 32, top-2 by sigmoid
# score plus a random expert bias (large enough to change which experts are chosen)
LFM2_MOE = {k: v for k, v in LFM2.items() if not k.startswith("block_")}
LFM2_MOE.update(model_type="lfm2_moe", intermediate_size=64, num_dense_layers=1,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                routed_scaling_factor=1.5)  # fmt: skip


def make_moe(root):
    """An LFM2-MoE checkpoint with random expert biases (transformers initialises them 0)."""
    from safetensors.torch import load_file, save_file

    root, ref = make_checkpoint(root, LFM2_MOE)
    path, gen = root / "model.safetensors", torch.Generator().manual_seed(5)
    state = load_file(path)
    for name, buf in ref.named_buffers():
        if name.endswith("expert_bias"):
            buf.copy_(torch.rand(buf.shape, generator=gen) * 2)
            state[name] = buf.clone()
    save_file(state, path, metadata={"format": "pt"})
    return root, ref


def edit_config(root, **changes):
    """Rewrite root's config.json with `changes` (None: drop the key)."""
    path = root / "config.json"
    cfg = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    root, ref = make_checkpoint(tmp_path_factory.mktemp("lfm2"), LFM2)
    return load_model(root, max_seq_len=160, max_batch_size=2), ref, root


class TestParity(ParitySuite):
    vocab = VOCAB
    prefill_len = 20
    decode = (24, 10)
    greedy_len, greedy_new = 9, 12
    ragged: ClassVar[dict] = dict(lengths=(5, 14), steps=3, new=8)

    @pytest.fixture
    def model(self, lfm2):
        return lfm2


@pytest.fixture(scope="module")
def lfm2_moe(tmp_path_factory):
    root, ref = make_moe(tmp_path_factory.mktemp("lfm2_moe"))
    return load_model(root, max_seq_len=64, max_batch_size=2), ref, root


class TestParityMoe(TestParity):
    ragged: ClassVar[dict] = dict(lengths=(5, 11), steps=2, new=6)

    @pytest.fixture
    def model(self, lfm2_moe):
        return lfm2_moe


def test_moe_expert_bias_moves_the_logits(lfm2_moe, tmp_path):
    """Without the expert bias (use_expert_bias false, its tensors dropped) the experts chosen
    differ and parity breaks."""
    from safetensors.torch import load_file, save_file

    m, ref, root = lfm2_moe
    assert m.config.moe.layers == (1, 2) and m.config.moe.topk_method == "noaux_tc"
    (tmp_path / "config.json").write_text((root / "config.json").read_text())
    state = {k: v for k, v in load_file(root / "model.safetensors").items()
             if not k.endswith("expert_bias")}  # fmt: skip
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    edit_config(tmp_path, use_expert_bias=False)
    x = ids(VOCAB, 1, 16)
    assert rel_err(load_model(tmp_path, max_seq_len=32).forward(x), ref(x).logits) > 10 * TOL


def test_layers_follow_layer_types(lfm2):
    m, _, _ = lfm2
    specs = m.config.attention_layers
    assert [type(s) for s in specs] == [ShortConvSpec, GQASpec, ShortConvSpec]
    assert specs[0] == ShortConvSpec(hidden=32, l_cache=4, bias=True)
    assert specs[1].qk_norm is not None and m.config.mlp.intermediate_size == 96
    assert m.config.state_bytes_per_sequence(4) == 2 * 32 * 3 * 4  # 2 conv layers, L - 1 = 3
    # the fused CPU decode step takes every block (tests/core/test_cpu_step.py: equal to these)
    assert why_not(m.net) is None
    assert kinds(m.net) == "2 x ShortConv + GatedMLP, 1 x GQAAttention + GatedMLP"


@torch.no_grad()
def test_chunked_prefill_equals_one_pass(lfm2):
    """A 70-token prompt prefilled in chunks of 1, 7 and 64 tokens leaves the conv states and
    the last logits of one pass."""
    m, ref, _ = lfm2
    x = ids(VOCAB, 1, 70, seed=4)
    want = ref(x).logits[:, -1]
    states = []
    for chunk in (70, 1, 7, 64):
        m.reset()
        for s in range(0, 70, chunk):
            out = m.forward(x[:, s : s + chunk], s)
        assert rel_err(out[:, -1], want) < TOL
        states.append([m.net.kv_cache.layer(i)[0][0].clone() for i in (0, 2)])
    for other in states[1:]:  # equal to fp32 rounding (a matmul's depends on its row count)
        for a, b in zip(states[0], other, strict=True):
            assert rel_err(b, a) < 1e-5


def test_state_restarts_and_padding_stays_out(lfm2):
    """A reused row restarts from zeros; a right-padded short row's decode equals it alone,
    and fails to when the padding is fed as tokens (no `lengths`)."""
    m, ref, _ = lfm2
    m.reset()
    m.forward(ids(VOCAB, 1, 30, seed=5))
    y = ids(VOCAB, 1, 12, seed=6)
    assert rel_err(m.forward(y), ref(y).logits) < TOL  # no reset between
    long, short = ids(VOCAB, 1, 20, seed=7)[0], ids(VOCAB, 1, 9, seed=8)[0]
    batch = torch.zeros(2, 20, dtype=torch.long)
    batch[0], batch[1, :8] = long, short[:8]
    want = ref(short[None]).logits[0, 8]
    for lengths, ok in (((20, 8), True), (None, False)):
        m.reset()
        m.forward(batch, lengths=lengths)
        step = m.forward(torch.stack([long[-1], short[8]])[:, None], torch.tensor([20, 8]))
        assert (rel_err(step[1, 0], want) < TOL) == ok


@pytest.mark.parametrize(
    "change",
    [
        dict(conv_bias=False),
        dict(conv_L_cache=3),
        dict(layer_types=["conv", "conv", "full_attention"]),
    ],
    ids=["conv_bias", "L_cache", "layer_pattern"],
)
def test_switching_a_feature_off_breaks_parity(tmp_path, change):
    """Each feature moves transformers' logits: our config without it cannot match (the
    checkpoint is rewritten without the tensors a switched-off feature does not have)."""
    from safetensors.torch import load_file, save_file

    root, ref = make_checkpoint(tmp_path, LFM2)
    edit_config(root, **change)
    path = root / "model.safetensors"
    state = load_file(path)
    if "conv_bias" in change:
        state = {k: v for k, v in state.items() if not (".conv." in k and k.endswith(".bias"))}
    if "conv_L_cache" in change:
        state = {k: v[..., 1:].contiguous() if k.endswith("conv.conv.weight") else v
                 for k, v in state.items()}  # fmt: skip
    if "layer_types" in change:  # layer 1 becomes conv, layer 2 attention: swap the tensors
        state = {_swap_layers(k): v for k, v in state.items()}
    save_file(state, path, metadata={"format": "pt"})
    m = load_model(root, max_seq_len=32)
    x = ids(VOCAB, 1, 16)
    assert rel_err(m.forward(x), ref(x).logits) > 10 * TOL


def _swap_layers(name: str) -> str:
    for a, b in ((".1.", ".2."), (".2.", ".1.")):
        if name.startswith(f"model.layers{a}"):
            return name.replace(a, b, 1)
    return name


def test_qk_norm_moves_the_logits(lfm2):
    """Unit q/k layernorm weights (what a model without them computes) change the logits."""
    m, ref, _ = lfm2
    x = ids(VOCAB, 1, 16)
    attn = m.net.model.layers[1].self_attn
    saved = attn.q_norm.weight.clone(), attn.k_norm.weight.clone()
    try:
        with torch.no_grad():
            attn.q_norm.weight.fill_(1), attn.k_norm.weight.fill_(1)
            m.reset()
            assert rel_err(m.forward(x), ref(x).logits) > 10 * TOL
    finally:
        with torch.no_grad():
            attn.q_norm.weight.copy_(saved[0]), attn.k_norm.weight.copy_(saved[1])


def test_legacy_keys_as_real_configs_carry_them(tmp_path):
    """full_attn_idxs (no layer_types), block_ff_dim over intermediate_size, tie_embedding,
    conv_L_cache / conv_bias / block_norm_eps as LFM2-1.2B's config.json spells them."""
    root, ref = make_checkpoint(tmp_path, LFM2)
    edit_config(root, layer_types=None, full_attn_idxs=[1], block_ff_dim=96,
                intermediate_size=4096, tie_embedding=True, tie_word_embeddings=None,
                block_norm_eps=1e-5, block_dim=32, conv_dim=32)  # fmt: skip
    m = load_model(root, max_seq_len=32)
    assert [type(s) for s in m.config.attention_layers] == [ShortConvSpec, GQASpec, ShortConvSpec]
    x = ids(VOCAB, 1, 16)
    assert rel_err(m.forward(x), ref(x).logits) < TOL


def test_bad_configs_name_the_field():
    with pytest.raises(ConfigError, match="layer_types"):
        Lfm2Config.from_dict({**LFM2, "layer_types": ["conv", "mamba", "conv"]}).to_runtime()
    with pytest.raises(ConfigError, match="conv_L_cache"):
        Lfm2Config.from_dict({**LFM2, "conv_L_cache": 1}).to_runtime()


def test_tensor_parallelism_refuses_the_conv_layer():
    cfg = Lfm2Config.from_dict(LFM2).to_runtime()
    with pytest.raises(ConfigError, match=r"layer 0's ShortConvSpec.*tp=1"):
        tp.check(cfg, 2, "config.json")
