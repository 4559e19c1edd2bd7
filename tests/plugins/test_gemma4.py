"""Gemma 4's text model against transformers on tiny random checkpoints (fp32): an E2B-style
model (window and global layers, global layers with their own head_dim and a proportional rope,
per-layer embeddings, the last two layers reading the K/V of earlier ones with double-wide MLPs,
v norms, layer scalars, a final soft-cap small enough to bite), in the hub's key style
(`global_head_dim`) and in transformers 5's (`per_layer_config`), and a multimodal `gemma4`
checkpoint (Gemma4ForConditionalGeneration) loading its text model."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import ClassVar

import pytest
import torch
from conftest import make_checkpoint, randomize
from fixtures.families import GEMMA4_TEXT as TEXT
from parity import ParitySuite, check_decode, check_prefill, ids, rel_err
from safetensors.torch import load_file, save_file

from core import ConfigError, load_model
from core.config import DefaultRope, ProportionalRope
from core.cpu_step import why_not
from core.layers.moe import StackedLinear
from core.plugins import registry
from kernels.blocks import BlockExperts

VOCAB = 128
GEMMA4 = dict(TEXT, model_type="gemma4_text")
# 26B-A4B in miniature: no per-layer inputs nor shared K/V; the global layer has one kv head
# whose values are its keys (k_eq_v); each layer's MLP beside 4 GeGLU experts, 2 per token
GEMMA4_MOE = dict(
    GEMMA4,
    num_hidden_layers=3,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    num_kv_shared_layers=0,
    use_double_wide_mlp=False,
    hidden_size_per_layer_input=0,
    attention_k_eq_v=True,
    num_global_key_value_heads=1,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,  # whole Q8_0 blocks: GGUF keeps the experts in them
    intermediate_size=24,
)


def hub_keys(cfg: dict, spec: dict) -> dict:
    """config.json as the released repos spell it: global_head_dim and
    num_global_key_value_heads, where transformers 5 writes per_layer_config."""
    cfg = {k: v for k, v in cfg.items() if k != "per_layer_config"}
    kv = spec.get("num_global_key_value_heads")
    return dict(cfg, global_head_dim=spec["global_head_dim"], num_global_key_value_heads=kv)


def gemma4_checkpoint(root, spec: dict, hub: bool = True, extra: dict | None = None):
    root, ref = make_checkpoint(root, spec, raw=True)
    with torch.no_grad():  # layer scalars other than their init (a buffer randomize() skips)
        for i, layer in enumerate(ref.model.layers):
            layer.layer_scalar.fill_(0.6 + 0.2 * i)
    ref.save_pretrained(root, safe_serialization=True)
    path = root / "config.json"
    cfg = json.loads(path.read_text())
    assert "global_head_dim" not in cfg  # transformers 5 saves per_layer_config instead
    path.write_text(json.dumps(hub_keys(cfg, spec) if hub else cfg, indent=1))
    if extra:  # tensors a real checkpoint keeps that transformers does not save
        tensors = load_file(root / "model.safetensors")
        save_file({**tensors, **extra}, root / "model.safetensors", metadata={"format": "pt"})
    return root, ref


# the released checkpoints keep k/v projections and norms on the layers that share K/V
UNUSED_KV = {
    "model.layers.3.self_attn.k_proj.weight": torch.zeros(16, 32),
    "model.layers.3.self_attn.v_proj.weight": torch.zeros(16, 32),
    "model.layers.3.self_attn.k_norm.weight": torch.ones(8),
    "model.layers.4.self_attn.k_proj.weight": torch.zeros(32, 32),
}


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    root, ref = gemma4_checkpoint(tmp_path_factory.mktemp("gemma4"), GEMMA4, True, UNUSED_KV)
    m = load_model(root, max_seq_len=64, max_batch_size=2)
    return m, ref


class TestParity(ParitySuite):
    """The parity checks of tests/plugins/parity.py on this module's models."""

    vocab = VOCAB
    prefill_len = 20  # 4x the window
    decode = (20, 11)  # decode past the window
    greedy_len = 9
    ragged: ClassVar[dict] = dict(lengths=(4, 11), steps=3, new=5)

    @pytest.fixture
    def model(self, gemma4):
        return gemma4


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory):
    root, ref = gemma4_checkpoint(tmp_path_factory.mktemp("gemma4-moe"), GEMMA4_MOE)
    m = load_model(root, max_seq_len=64, max_batch_size=2)
    return m, ref


class TestMoEParity(ParitySuite):
    """The parity checks on the MoE model."""

    vocab = VOCAB
    decode = (16, 9)
    ragged: ClassVar[dict] = dict(lengths=(4, 9), steps=2, new=4)

    @pytest.fixture
    def model(self, gemma4_moe):
        return gemma4_moe


def test_moe_layers_read_as_transformers(gemma4_moe):
    m = gemma4_moe[0]
    glob = m.net.model.layers[2].self_attn.spec
    assert glob.k_eq_v and glob.num_kv_heads == 1 and glob.head_dim == 16
    assert m.net.model.layers[2].self_attn.qkv_proj.weight.shape[0] == 4 * 16 + 16  # q, k
    mlp = m.config.layer_mlp(0)
    assert (mlp.dense.intermediate_size, mlp.moe.num_experts, mlp.moe.top_k) == (24, 4, 2)
    assert m.config.per_layer_input is None
    assert "layer scalar" in why_not(m.net)


def test_layer_specs_read_as_transformers(gemma4):
    m = gemma4[0]
    specs = [layer.self_attn.spec for layer in m.net.model.layers]
    assert [s.window for s in specs] == [5, None, 5, 5, None]
    assert [s.head_dim for s in specs] == [8, 16, 8, 8, 16]
    assert [s.kv_source for s in specs] == [None, None, None, 2, 1]
    assert {s.scale for s in specs} == {1.0} and {s.v_norm for s in specs} == {1e-6}
    assert m.config.layer_rope(0) == DefaultRope(theta=10000.0, dim=8)
    assert m.config.layer_rope(1) == ProportionalRope(theta=1e6, dim=16, rotated=2)
    widths = [m.config.layer_mlp(i).intermediate_size for i in range(5)]
    assert widths == [48, 48, 48, 96, 96]  # double-wide where K/V is shared
    assert m.config.final_softcap == 3.0


def test_transformers5_keys(tmp_path):
    """config.json as transformers 5 saves it (per_layer_config, no global_head_dim)."""
    root, ref = gemma4_checkpoint(tmp_path, GEMMA4, hub=False)
    m = load_model(root, max_seq_len=32)
    assert [layer.self_attn.spec.head_dim for layer in m.net.model.layers] == [8, 16, 8, 8, 16]
    check_decode(m, ref, ids(VOCAB, 1, 16), prefill=9)


def test_shared_layers_cache_nothing(gemma4):
    """Layers 3 and 4 have no cache tensors; the bytes per token count global layer 1 alone."""
    m = gemma4[0]
    assert m.net.kv_cache.layer(3) == () and m.net.kv_cache.layer(4) == ()
    assert m.config.kv_bytes_per_token(4) == 2 * 2 * 16 * 4  # k and v, 2 heads of 16, fp32
    assert "per-layer inputs" in why_not(m.net)


def test_fused_cpu_step_refuses_each_attention_feature():
    """Past the per-layer inputs and layer scalars, the fused step still refuses value norms
    and layers without a cache of their own (it would run them as plain GQA layers)."""
    from core.modeling import CausalLM

    cfg = replace(to_runtime(GEMMA4), per_layer_input=None, layer_scalar=False)
    assert why_not(CausalLM(cfg)) == "block 0 norms its values, or takes them from k_proj (Gemma 4)"
    plain = tuple(replace(a, v_norm=None) for a in cfg.attention_layers)
    net = CausalLM(replace(cfg, attention_layers=plain))
    assert why_not(net) == "block 3 reads the keys and values of layer 2 (no cache of its own)"


@torch.no_grad()
def test_each_feature_moves_the_logits(tmp_path):
    """Each Gemma 4 feature, switched off on the loaded model, changes the logits (so the
    parity tests exercise it): v norm, proportional rope, per-layer inputs, layer scalars, the
    layer K/V is shared from, the final soft-cap."""
    root, _ = gemma4_checkpoint(tmp_path, GEMMA4)
    m = load_model(root, max_seq_len=32)
    x = ids(VOCAB, 1, 16)
    want = m.forward(x)
    blocks = m.net.model.layers

    def moved(edit) -> bool:
        undo = edit()
        m.reset()
        got = m.forward(x)
        undo()
        return rel_err(got, want) > 1e-3

    def swap(obj, name, value):
        def edit():
            old = getattr(obj, name)
            setattr(obj, name, value)
            return lambda: setattr(obj, name, old)

        return edit

    attn = blocks[2].self_attn
    assert moved(swap(attn, "spec", replace(attn.spec, v_norm=None)))
    assert moved(swap(m.net, "kv_lists", [0, 1, None, 0, 1]))  # layer 3 reads layer 0's K/V
    assert moved(swap(blocks[1], "per_layer_input", None))
    assert moved(swap(blocks[0], "layer_scalar", None))
    full = DefaultRope(theta=1e6, dim=16)  # every frequency turning
    rotary = m.net.rotaries[m.net.rope_of_layer[1]]
    assert moved(swap(rotary, "cos", type(rotary)(full, 32, "cpu").cos))
    cfg = m.config
    assert moved(swap(m.net, "config", replace(cfg, final_softcap=None)))


def test_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """A Gemma4ForConditionalGeneration checkpoint: the vision tower and its embedder are
    skipped, text logits equal transformers' (prefill and decode)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    vision.update(num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    cfg = Gemma4Config(text_config=TEXT, vision_config=vision, audio_config=None)
    torch.manual_seed(0)
    ref = Gemma4ForConditionalGeneration(cfg).eval()
    randomize(ref)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    names = load_file(tmp_path / "model.safetensors")
    assert any(n.startswith("model.vision_tower.") for n in names)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["text_config"] = hub_keys(raw["text_config"], TEXT)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    m = load_model(tmp_path, max_seq_len=32)
    assert m.config.model_type == "gemma4" and m.config.per_layer_input is not None
    check_prefill(m, ref, ids(VOCAB, 1, 14))
    check_decode(m, ref, ids(VOCAB, 1, 14), prefill=8)


def to_runtime(raw: dict):
    return registry().architecture(raw["model_type"]).config.from_dict(raw).to_runtime()


def test_tensor_parallelism_refuses_gemma4_blocks():
    """No split rule for per-layer inputs, shared K/V or the dense + routed MLP yet: tp=2 is
    refused with the reason, not run wrong."""
    from core.parallel import tp

    with pytest.raises(ConfigError, match="shared K/V"):
        tp.check(to_runtime(GEMMA4), 2, "config.json")
    with pytest.raises(ConfigError, match="K = V attention"):
        tp.check(to_runtime(GEMMA4_MOE), 2, "config.json")


def test_tensor_parallelism_cuts_the_per_layer_mlps():
    """A Gemma 4 of plain blocks (no per-layer inputs, shared K/V nor K = V) splits: each
    rank's per-layer MLPs are its cut of the model's, as the checkpoint's rows are cut (they
    were built whole: the load failed on every MLP weight); tests/core/test_tp.py runs it."""
    from core.parallel import tp

    cfg = to_runtime(dict(GEMMA4, num_kv_shared_layers=0, hidden_size_per_layer_input=0))
    assert len(cfg.mlp_layers) == 5
    tp.check(cfg, 2, "config.json")
    local = tp.local_config(cfg, 2)
    assert [local.layer_mlp(i).intermediate_size for i in range(5)] == [24] * 5


def test_bad_configs_name_the_field():
    with pytest.raises(ConfigError, match="top_k_experts"):
        to_runtime(dict(GEMMA4_MOE, top_k_experts=None))
    with pytest.raises(ConfigError, match="num_kv_shared_layers"):
        to_runtime(dict(GEMMA4, num_kv_shared_layers=4))  # no global layer left before 1
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        to_runtime(dict(GEMMA4, use_bidirectional_attention="all"))
    bad = {"full_attention": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ConfigError, match=r"rope_parameters\.full_attention"):
        to_runtime(dict(GEMMA4, rope_parameters=bad))
    uneven = {"1": {"head_dim": 16}, "4": {"head_dim": 32}}
    with pytest.raises(ConfigError, match="per_layer_config"):
        to_runtime(dict(GEMMA4, per_layer_config=uneven))


def test_defaults_are_transformers():
    """An E2B-like config with few keys gets transformers' layer pattern and ropes."""
    cfg = to_runtime(dict(model_type="gemma4_text", num_hidden_layers=7, hidden_size=64))
    assert [a.window for a in cfg.attention_layers] == [512] * 5 + [None, None]
    assert cfg.rope == ProportionalRope(theta=1e6, dim=512, rotated=64)
    assert cfg.per_layer_input.dim == 256 and cfg.layer_scalar


@pytest.mark.parametrize(
    ("name", "repo", "kv_bytes"),
    [
        # bf16 K/V of global layers 4, 9 and 14 alone: one kv head of 512
        ("gemma4", "google/gemma-4-E2B-it", 3 * 2 * 512 * 2),
        # the 5 global layers: 2 kv heads of 512; V (k_proj's output, v-normed) cached beside K
        ("gemma4-moe", "google/gemma-4-26B-A4B-it", 5 * 2 * 2 * 512 * 2),
    ],
)
def test_registry_shapes_build_the_published_models(name, repo, kv_bytes):
    """registry.yaml's Gemma 4 shapes build (on the meta device) the published text models."""
    from core.catalog import named_models
    from core.modeling import CausalLM

    entry = named_models()[name]
    assert entry["repo"] == repo
    cfg = to_runtime(entry["shape"])
    with torch.device("meta"):
        net = CausalLM(cfg)
    assert f"{sum(p.numel() for p in net.parameters()) / 1e9:.2f}B" == entry["params"]
    assert cfg.kv_bytes_per_token(2) == kv_bytes


@pytest.mark.parametrize("spec", [GEMMA4, GEMMA4_MOE], ids=["e2b-like", "moe"])
@torch.no_grad()
def test_gguf_file_from_llama_cpps_converter_equals_the_checkpoint(tmp_path, spec):
    """llama.cpp's converter writes each tiny checkpoint as a `gemma4` GGUF file (per-layer
    arrays, the proportional rope as rope_freqs; the MoE's stacked experts, router scales and
    K = V global layer); loaded, it is the checkpoint's config and logits, and its tokenizer and
    chat template are the folder's."""
    from fixtures.gemma_tokenizer import build_gemma_tokenizer_folder
    from fixtures.llama_cpp_convert import convert

    folder = tmp_path / "hf"
    special = build_gemma_tokenizer_folder(folder)
    ids_ = {k: special[t] for k, t in (("bos_token_id", "<bos>"), ("pad_token_id", "<pad>"))}
    vocab = special["vocab_size"]
    spec = dict(spec, **ids_, eos_token_id=special["<end_of_turn>"], vocab_size=vocab)
    gemma4_checkpoint(folder, dict(spec, vocab_size_per_layer_input=vocab))
    path = convert(folder, tmp_path / "f32.gguf", also={"q8_0": tmp_path / "q8_0.gguf"})
    kw = dict(max_seq_len=64, max_batch_size=2, dtype="float32")
    ours, theirs = load_model(path, **kw), load_model(folder, **kw)
    assert ours.config == theirs.config
    x = ids(vocab, 2, 24)
    assert rel_err(ours.forward(x), theirs.forward(x)) < 1e-5
    # the Q8_0 file kept in its blocks (the MoE's experts too: the GeGLU loop reads them)
    # gives the greedy tokens of the same file dequantized
    kept = load_model(tmp_path / "q8_0.gguf", max_seq_len=64)
    floats = load_model(tmp_path / "q8_0.gguf", max_seq_len=64, dequantize=True)
    stacked = [m.weight for m in kept.net.modules() if isinstance(m, StackedLinear)]
    assert all(isinstance(w, BlockExperts) for w in stacked)
    prompt = x[0, :8].tolist()
    want = floats.generate(prompt, max_new_tokens=6).token_ids
    assert kept.generate(prompt, max_new_tokens=6).token_ids == want
    text = "The quick brown fox: why is the sky blue? Because air scatters light.\n"
    assert ours.tokenizer.encode(text) == theirs.tokenizer.encode(text)
    chat = [{"role": "user", "content": text}]
    assert ours.tokenizer.apply_chat_template(chat) == theirs.tokenizer.apply_chat_template(chat)
