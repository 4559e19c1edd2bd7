"""Nemotron-H (`nemotron_h`) against transformers (fp32) on tiny random checkpoints written as the
hub ships them (`backbone.*`, per-expert tensors, `hybrid_override_pattern` in config.json):

- Nemotron 3 Nano-like "M-M*ME": Mamba2, relu2 MLP, NoPE attention and a MoE layer (sigmoid
  noaux_tc routing over 2 groups with a non-zero e_score_correction_bias, routed_scaling_factor,
  relu2 experts and a shared expert);
- Nano 2-like dense "M-M*-".
Prompts span several Mamba2 chunks (chunk_size 16). Each feature the config or the weights
switch (the pattern, the routing bias, D, the dt floor, the conv width) is shown to move
transformers' logits, and Zoo to follow.
"""

from __future__ import annotations

import json
import shutil
from typing import ClassVar

import pytest
import torch
from conftest import make_checkpoint, save_in_memory_names
from fixtures.fused_steps import decode, feed
from fixtures.fused_steps import rel_err as fused_err
from parity import ParitySuite, ids, rel_err
from safetensors.torch import load_file, save_file

from core import CheckpointError, ConfigError, load_model
from core.config import GQASpec
from core.config_kinds import NoSubBlock
from plugins.nemotron_h import NemotronHConfig

VOCAB = 96
COMMON = dict(
    model_type="nemotron_h",
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    mamba_num_heads=4,
    mamba_head_dim=16,
    ssm_state_size=8,
    n_groups=2,
    conv_kernel=4,
    chunk_size=16,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
MOE = dict(
    COMMON,
    layers_block_type="M-M*ME",  # written back as the hub's hybrid_override_pattern
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    moe_shared_expert_intermediate_size=40,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
)
DENSE = dict(COMMON, layers_block_type="M-M*-")
KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def make(root, spec: dict, seed: int = 0):
    """The checkpoint as the hub has it: config.json with hybrid_override_pattern and
    num_hidden_layers, and (MoE) a random e_score_correction_bias (a buffer transformers
    leaves at zero) large enough to change which experts win."""
    pattern = spec["layers_block_type"]
    spec = dict(spec, layers_block_type=[KINDS[c] for c in pattern])
    root, ref = make_checkpoint(root, spec, seed=seed)
    path = root / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("layers_block_type")
    path.write_text(json.dumps({**cfg, "hybrid_override_pattern": pattern,
                                "num_hidden_layers": len(pattern)}))  # fmt: skip
    state = load_file(root / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for name, buf in ref.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.rand(buf.shape, generator=g) * 0.5)
            state[name.replace("model.", "backbone.", 1)] = buf.clone()
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    return root, ref


@pytest.fixture(scope="module", params=["moe", "dense"])
def nemotron(request, tmp_path_factory):
    root, ref = make(
        tmp_path_factory.mktemp(request.param), MOE if request.param == "moe" else DENSE
    )
    return load_model(root, max_seq_len=96, max_batch_size=2), ref, root


class TestParity(ParitySuite):
    """Prefill over 40 tokens (3 chunks), decode 8 steps after 24, ragged rows of 37 and 20."""

    vocab = VOCAB
    prefill_len = 40
    decode = (32, 24)
    greedy_len, greedy_new = 20, 12
    ragged: ClassVar[dict] = dict(lengths=(37, 20), steps=3, new=8)

    @pytest.fixture
    def model(self, nemotron):
        return nemotron


def test_layers_follow_the_pattern(nemotron):
    m, _, root = nemotron
    pattern = json.loads((root / "config.json").read_text())["hybrid_override_pattern"]
    cfg = m.config
    for i, c in enumerate(pattern):
        attn, mlp = cfg.layer_attention(i), cfg.layer_mlp(i)
        assert isinstance(attn, NoSubBlock) == (c in "-E")
        assert isinstance(mlp, NoSubBlock) == (c in "M*")
        assert isinstance(attn, GQASpec) == (c == "*")
        assert (cfg.moe is not None and i in cfg.moe.layers) == (c == "E")
    assert cfg.layer_rope(pattern.index("*")) is None  # NoPE attention
    blocks = m.net.model.layers
    assert blocks[1].self_attn is None and not hasattr(blocks[1], "post_attention_layernorm")
    assert blocks[0].mlp is None
    assert cfg.kv_bytes_per_token(4) == 2 * 2 * 8 * 4  # the one attention layer's K and V
    from core.cli.info import _layer_kinds, _ropes  # zoo info's lines

    kinds = dict(p.rsplit(" x ", 1) for p in _layer_kinds(cfg).split(", "))
    mlp_only = str(pattern.count("-") + pattern.count("E"))
    assert kinds == {"mamba2": str(pattern.count("M")), "full": "1", "NoPE": "1",
                     "MLP only": mlp_only}  # fmt: skip
    assert _ropes(cfg) == "none"


def test_the_fused_cpu_step_takes_every_layer_kind(nemotron):
    """Mamba2, NoPE attention, relu2 MLP and MoE layers (relu2 experts, shared expert), each
    of one sub-block, decode through the C blocks (core/cpu_step.py) as through the modules,
    ragged rows step by step; `zoo info` says the step is taken."""
    from core import cpu_step
    from core.cli.info import _decode_path

    m, _, root = nemotron
    assert cpu_step.why_not(m.net) is None
    # zoo info's block kinds: one mixer per layer, "2 x Mamba2, 1 x GatedMLP, ..." for M-M*ME
    pattern = json.loads((root / "config.json").read_text())["hybrid_override_pattern"]
    want = f"{pattern.count('M')} x Mamba2, {pattern.count('-')} x GatedMLP, 1 x GQAAttention"
    assert _decode_path(m) == f"eager, fused C blocks (core/cpu_step.py): {cpu_step.kinds(m.net)}"
    assert cpu_step.kinds(m.net).startswith(want)
    tokens = feed()
    for got, want in zip(decode(m, True, tokens), decode(m, False, tokens), strict=True):
        assert fused_err(got, want) < 1e-5


def test_tensor_parallelism_refuses_by_name(nemotron):
    from core.parallel import tp

    with pytest.raises(ConfigError, match=r"tp=2: .*run it with tp=1"):
        tp.check(nemotron[0].config, 2, "config.json")


def _variant(base, ref, tmp_path, edit_state=None, edit_cfg=None):
    """A copy of checkpoint `base` with its tensors and config.json edited; asserts that the
    edit moves transformers' logits on a 40-token prompt and that Zoo equals the new ones."""
    from transformers import AutoModelForCausalLM

    root = tmp_path / "variant"
    shutil.copytree(base, root)
    state = load_file(root / "model.safetensors")
    if edit_state:
        edit_state(state)
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**cfg, **(edit_cfg or {})}))
    other = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    x = ids(VOCAB, 1, 40, seed=4)
    with torch.no_grad():
        before, want = ref(x).logits, other(x).logits
    assert rel_err(before, want) > 1e-3  # the feature changes transformers' output
    m = load_model(root, max_seq_len=64)
    assert rel_err(m.forward(x), want) < 1e-4


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return make(tmp_path_factory.mktemp("moe_variants"), MOE)


def _all(state, suffix, fn):
    for k in [k for k in state if k.endswith(suffix)]:
        state[k] = fn(state[k])


def test_routing_bias_moves_the_logits(moe_ckpt, tmp_path):
    _variant(*moe_ckpt, tmp_path, lambda s: _all(s, "e_score_correction_bias", torch.zeros_like))


def test_d_skip_moves_the_logits(moe_ckpt, tmp_path):
    _variant(*moe_ckpt, tmp_path, lambda s: _all(s, "mixer.D", torch.zeros_like))


def test_dt_floor_moves_the_logits(moe_ckpt, tmp_path):
    # transformers clamps softplus(dt + dt_bias) from below by time_step_min (0.001 by default,
    # which these weights never reach); 0.9 lifts most of them
    _variant(*moe_ckpt, tmp_path, edit_cfg={"time_step_min": 0.9})


def test_conv_width_moves_the_logits(moe_ckpt, tmp_path):
    # conv_kernel 2: each conv keeps its last two taps (those of the current and last token)
    _variant(*moe_ckpt, tmp_path, lambda s: _all(s, "conv1d.weight", lambda w: w[..., 2:].clone()),
             {"conv_kernel": 2})  # fmt: skip


def test_pattern_moves_the_logits(moe_ckpt, tmp_path):
    """Layers 0 (M) and 1 (-) trade places, in the weights and in the pattern: "-MM*ME"."""

    def swap(state):
        a, b = "backbone.layers.0.", "backbone.layers.1."
        moved = {(b + k[len(a):] if k.startswith(a) else a + k[len(b):]): state.pop(k)
                 for k in [k for k in state if k.startswith((a, b))]}  # fmt: skip
        state.update(moved)

    _variant(*moe_ckpt, tmp_path, swap, {"hybrid_override_pattern": "-MM*ME"})


def test_transformers5_in_memory_names_load_the_same(moe_ckpt, tmp_path):
    """model.* names and each layer's experts stacked whole (`mixer.experts.up_proj`)."""
    root = tmp_path / "in_memory"
    shutil.copytree(moe_ckpt[0], root)
    state = save_in_memory_names(root, moe_ckpt[1])
    assert "model.layers.5.mixer.experts.up_proj" in state
    x = ids(VOCAB, 1, 40, seed=4)
    with torch.no_grad():
        want = moe_ckpt[1](x).logits
    assert rel_err(load_model(root, max_seq_len=64).forward(x), want) < 1e-4


def test_router_and_its_bias_stay_fp32_in_a_bf16_model(moe_ckpt):
    m = load_model(moe_ckpt[0], max_seq_len=16, dtype="bfloat16")
    gate = m.net.model.layers[5].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert m.net.model.layers[5].mlp.experts.up_proj.weight.dtype == torch.bfloat16


def test_a_pattern_that_does_not_fit_the_weights_is_refused(moe_ckpt, tmp_path):
    root = tmp_path / "bad"
    shutil.copytree(moe_ckpt[0], root)
    cfg = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**cfg, "hybrid_override_pattern": "M-M-ME"}))
    with pytest.raises(CheckpointError, match=r"backbone\.layers\.3\.mixer\.q_proj\.weight"):
        load_model(root, max_seq_len=64)


def test_layers_block_type_reads_as_the_pattern():
    raw = {k: v for k, v in MOE.items() if k != "layers_block_type"}
    words = ["mamba", "mlp", "mamba", "attention", "mamba", "moe"]
    a = NemotronHConfig.from_dict({**raw, "hybrid_override_pattern": "M-M*ME"}).to_runtime()
    b = NemotronHConfig.from_dict({**raw, "layers_block_type": words}).to_runtime()
    assert a == b and a.num_layers == 6
    # the older hub keys of the Mamba fields, as transformers renames them
    old = {"mamba_n_groups": 2, "mamba_d_conv": 4, "mamba_chunk_size": 16, "mamba_dt_min": 0.001}
    raw = {k: v for k, v in raw.items() if k not in ("n_groups", "conv_kernel", "chunk_size")}
    c = NemotronHConfig.from_dict({**raw, **old, "hybrid_override_pattern": "M-M*ME"})
    assert c.to_runtime() == a


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hybrid_override_pattern": "M-X"}, "hybrid_override_pattern"),
        ({"hybrid_override_pattern": "M-M", "num_hidden_layers": 4}, "num_hidden_layers"),
        ({"layers_block_type": ["mamba", "conv"]}, "layers_block_type"),
        ({"hybrid_override_pattern": "ME", "moe_latent_size": 16}, "moe_latent_size"),
        ({"hybrid_override_pattern": "ME", "n_group": 3}, "n_group"),
        ({"hybrid_override_pattern": "M*", "mamba_num_heads": 3}, "n_groups"),
    ],
)
def test_bad_configs_name_the_field(changes, message):
    raw = {k: v for k, v in MOE.items() if k != "layers_block_type"}
    with pytest.raises(ConfigError, match=message):
        NemotronHConfig.from_dict({**raw, **changes}).to_runtime()


def test_a_block_without_mlp_refuses_what_it_would_skip():
    """A NoSubBlock MLP ends the block after its attention, so post-norms, per-layer inputs or
    a layer scalar on such a layer (no family has them) are refused, not silently skipped."""
    from dataclasses import replace

    from core.modeling import DecoderBlock

    cfg = NemotronHConfig.from_dict(dict(COMMON, hybrid_override_pattern="M-")).to_runtime()
    DecoderBlock(cfg, 0)  # Mamba2 alone: built
    for more in (dict(post_norms=True), dict(layer_scalar=True)):
        with pytest.raises(ValueError, match="layer 0: a block without an MLP"):
            DecoderBlock(replace(cfg, **more), 0)
