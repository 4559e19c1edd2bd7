"""Falcon-H1 (`falcon_h1`) against transformers (fp32) on a tiny random checkpoint: attention
(head_dim 16 != hidden / heads, biases) and Mamba2 (2 groups of B / C, mamba_d_ssm narrower
than mamba_expand x hidden, in_proj and out_proj biases, chunks of 16 tokens) in parallel on
every layer, every muP multiplier != 1, prompts of 40 tokens over several chunks.

The module's checkpoint has no Mamba2 norm (mamba_rms_norm false, as TII's configs ship);
a second one, prefill only, has the gated norm normed before the gate. Switching off the
parallel Mamba2 branch, the attention, and each multiplier moves transformers' logits, so the
parity tests would catch Zoo missing it.
"""

from __future__ import annotations

import shutil
from typing import ClassVar

import pytest
import torch
from conftest import make_checkpoint
from fixtures.recurrent import slow_decay
from parity import ParitySuite, check_prefill, ids
from test_granite_hybrid import logits_moved, swap_attr, undo_all

from core import ConfigError, load_model
from core.config_kinds import ParallelMixerSpec
from core.cpu_step import why_not
from core.engine import Engine
from core.errors import ZooError
from core.generation import Seq
from core.sampling import SamplingParams
from plugins.falcon_h1 import FalconH1Config

VOCAB = 96
FALCON = dict(
    model_type="falcon_h1", vocab_size=VOCAB, hidden_size=48, intermediate_size=40,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    attention_bias=True, mlp_bias=True, mamba_proj_bias=True, projectors_bias=True,
    mamba_d_ssm=48, mamba_n_heads=4, mamba_d_head=12, mamba_d_state=8, mamba_n_groups=2,
    mamba_d_conv=4, mamba_chunk_size=16, mamba_expand=2, mamba_rms_norm=False,
    mamba_norm_before_gate=False, embedding_multiplier=2.0, lm_head_multiplier=0.6,
    attention_in_multiplier=0.8, attention_out_multiplier=1.5, key_multiplier=0.5,
    ssm_in_multiplier=1.25, ssm_out_multiplier=0.7, mlp_multipliers=[0.9, 0.6],
    ssm_multipliers=[0.35, 0.5, 1.4, 0.7, 1.6], max_position_embeddings=256,
    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
NORMED = dict(FALCON, mamba_rms_norm=True, mamba_norm_before_gate=True)
MULTIPLIERS = ("embedding_multiplier", "lm_head_multiplier", "attention_in_multiplier",
               "attention_out_multiplier", "key_multiplier", "ssm_in_multiplier",
               "ssm_out_multiplier")  # fmt: skip


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    root, ref = make_checkpoint(tmp_path_factory.mktemp("falcon_h1"), FALCON)
    return load_model(root, max_seq_len=64, max_batch_size=2), ref, root


class TestParity(ParitySuite):
    vocab = VOCAB
    prefill_len = 40
    decode = (44, 37)
    greedy_len, greedy_new = 20, 8
    ragged: ClassVar[dict] = dict(lengths=(40, 23), steps=3, new=5)

    @pytest.fixture
    def model(self, falcon):
        return falcon


def test_layers_and_multipliers_follow_the_config(falcon):
    m, _, _ = falcon
    cfg = m.config
    assert all(type(s) is ParallelMixerSpec for s in cfg.attention_layers)
    spec = cfg.attention_layers[0]
    assert spec.attention.head_dim == 16 and spec.mamba.intermediate == 48
    assert spec.mamba.gated_norm == "none" and spec.mamba.out_bias
    assert cfg.embedding.scale == 2.0 and cfg.logits_scale == 0.6
    assert not hasattr(m.net.model.layers[0].self_attn.mamba, "norm")  # no norm weight
    assert m.net.kv_cache.recurrent and m.net.kv_cache.state_bytes > 0  # snapshots work
    assert "ParallelMixer" in why_not(m.net)  # the fused CPU step refuses it by name


def _answer(model, engine: Engine, prompt: list[int]) -> Seq:
    """Six greedy tokens for `prompt` through `engine`'s step loop."""
    p = SamplingParams.build(model.defaults, max_new_tokens=6, temperature=0.0, ignore_eos=True)
    s = Seq(prompt, p, set(), None, VOCAB, model.device)
    engine.add(s)
    while engine.running:
        engine.step()
    return s


def test_a_diverging_prompt_resumes_from_a_snapshot(falcon, tmp_path):
    """Prefix reuse over the parallel layers: a prompt sharing 36 tokens of a 46-token history
    resumes at the snapshot at 32 (one every 16 tokens): the row's keys cut back to 32 and its
    Mamba2 state restored from the snapshot; it answers as a cold run. The state decays slowly
    (fixtures/recurrent.py), so a wrong one would answer wrong."""
    root = slow_decay(shutil.copytree(falcon[2], tmp_path / "slow"))
    warm = load_model(root, max_seq_len=64, max_batch_size=2)
    warm.net.setup_caches(2, 64, snapshots=3, snapshot_interval=16)
    m = load_model(root, max_seq_len=64, max_batch_size=2, snapshots=0)
    engine = Engine(warm, 2, reuse=True)
    history = ids(VOCAB, 1, 40, seed=5)[0].tolist()
    _answer(warm, engine, history)
    prompt = history[:36] + ids(VOCAB, 1, 8, seed=6)[0].tolist()
    got = _answer(warm, engine, prompt)
    assert got.cached == 32
    assert got.out == _answer(m, Engine(m, 2), prompt).out


@torch.no_grad()
def test_mamba_normed_before_its_gate(tmp_path):
    """mamba_rms_norm with mamba_norm_before_gate: RMSNorm(y) * silu(z); the norm's weight
    and its place before the gate both move transformers' logits."""
    root, ref = make_checkpoint(tmp_path, NORMED, seed=1)
    x = ids(VOCAB, 1, 40)
    check_prefill(load_model(root, max_seq_len=64), ref, x)
    want = ref(x).logits
    norms = [layer.mamba.norm for layer in ref.model.layers]
    undo = undo_all(*[swap_attr(n, "norm_before_gate", False) for n in norms])
    assert logits_moved(ref, x, want, lambda: undo) > 100 * 1e-4
    assert (
        logits_moved(ref, x, want, lambda: undo_all(*[_fill(n.weight, 1.0) for n in norms])) > 1e-2
    )


def _fill(p, value):
    old = p.detach().clone()
    with torch.no_grad():
        p.fill_(value)
    return lambda: p.data.copy_(old)


def _config_to_one(ref, name):
    """A multiplier set to 1 where transformers reads it (the layer, mixer, model)."""
    layers = ref.model.layers
    where = {
        "embedding_multiplier": [ref.model],
        "lm_head_multiplier": [ref.model],
        "attention_in_multiplier": layers,
        "attention_out_multiplier": [la for la in layers],
        "key_multiplier": [la.self_attn for la in layers],
        "ssm_in_multiplier": [la.mamba for la in layers],
        "ssm_out_multiplier": layers,
    }[name]
    attr = {"attention_out_multiplier": "attn_out_multiplier"}.get(name, name)
    return undo_all(*[swap_attr(o, attr, 1.0) for o in where])


@torch.no_grad()
def test_each_feature_moves_transformers_logits(falcon):
    """Switched off in transformers, the parallel branches and each multiplier move its logits
    well past the parity bar (the mup vector and MLP multipliers as a whole)."""
    _, ref, _ = falcon
    x = ids(VOCAB, 1, 40)
    want = ref(x).logits
    layers = ref.model.layers
    switches = {name: (lambda n=name: _config_to_one(ref, n)) for name in MULTIPLIERS}
    switches |= {
        "mamba branch": lambda: undo_all(
            *[swap_attr(la, "ssm_out_multiplier", 0.0) for la in layers]
        ),
        "attention branch": lambda: undo_all(
            *[swap_attr(la, "attn_out_multiplier", 0.0) for la in layers]
        ),
        "ssm_multipliers": lambda: undo_all(*[_fill(la.mamba.mup_vector, 1.0) for la in layers]),
        "mlp_multipliers": lambda: undo_all(
            *[
                swap_attr(la.feed_forward, a, 1.0)
                for la in layers
                for a in ("gate_multiplier", "down_multiplier")
            ]
        ),
    }
    moved = {name: logits_moved(ref, x, want, switch) for name, switch in switches.items()}
    assert min(moved.values()) > 100 * 1e-4, moved


def test_tensor_parallelism_refuses_it(falcon):
    from core.parallel.tp import check

    with pytest.raises(ConfigError, match="ParallelMixerSpec"):
        check(falcon[0].config, 2, "config.json")


def test_no_multipliers_nothing_folded():
    plain = {k: v for k, v in FALCON.items() if not k.endswith(("multiplier", "multipliers"))}
    assert FalconH1Config.from_dict(plain).weight_scales() == {}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mamba_d_head": 20}, "mamba_d_head"),
        ({"mamba_n_groups": 3}, "mamba_n_groups"),
        ({"mamba_d_conv": 1}, "mamba_d_conv"),
        ({"ssm_multipliers": [1.0, 2.0]}, "ssm_multipliers"),
    ],
)
def test_bad_configs_name_the_field(changes, message):
    with pytest.raises(ZooError, match=message):
        FalconH1Config.from_dict({**FALCON, **changes}).to_runtime()
