"""Tensor parallelism (core/parallel/tp.py) over two gloo ranks on the CPU equals the single
process.

One spawned pair of ranks loads every tiny checkpoint with tp=2 (so the process start, the
costly part, is paid once) and saves its figures; the test process loads the same folders
alone and compares: fp32 logits within 1e-5 relative to the largest, greedy tokens identical,
seeded sampling identical on both ranks, each rank's parameter bytes at most 0.55x.
"""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch
import tp_ranks
from conftest import LLAMA31, LLAMA32, make_checkpoint, save_in_memory_names

from core import ConfigError, load_model
from core.parallel import tp as tp_mod
from plugins.llama3 import LlamaConfig

QWEN2 = dict(
    model_type="qwen2",
    vocab_size=95,  # odd: the last rank's vocab rows are padded
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
# MLA with q_lora, sigmoid noaux_tc routing over 2 groups, a shared expert, one dense layer
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=0,
    eos_token_id=1,
)
MIXTRAL = dict(
    model_type="mixtral",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=1e6,
    sliding_window=None,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
# Phi-3: q|k|v and gate|up stored fused (cut per part), a sliding window shorter than the prompt
PHI3 = dict(
    model_type="phi3",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    original_max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    sliding_window=6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# tests/plugins/test_gemma4.py's, less its per-layer inputs and shared K/V: per-layer MLPs
# (mlp_layers), layer scalars, v norms, 4 kv heads on the global layers' wider head_dim
GEMMA4_PLAIN = dict(
    model_type="gemma4_text",
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_global_key_value_heads=4,
    head_dim=8,
    global_head_dim=16,
    max_position_embeddings=128,
    sliding_window=5,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    final_logit_softcapping=3.0,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
RAW = {"gemma4"}  # saved as transformers 5 writes it
# Llama 4: chunked attention on the roped layers, a NoPE layer with query temperature, L2 q/k
# norms, experts weighting their input (every other layer) beside a shared expert
LLAMA4 = dict(
    model_type="llama4_text",
    vocab_size=128,
    hidden_size=32,
    intermediate_size=24,
    intermediate_size_mlp=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    attention_chunk_size=4,
    floor_scale=2,
    attn_scale=0.5,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# GLM-4.5: per-head q/k norms, half the head dims roped, sigmoid noaux_tc routing, a shared expert
GLM45 = dict(
    model_type="glm4_moe",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    use_qk_norm=True,
    partial_rotary_factor=0.5,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
)
# llama3.2: 2 KV heads split; llama3.1: 1 KV head, replicated on both ranks, untied head;
# mixtral-stacked: experts stored as transformers 5 holds them, (E, 2I, H) and (E, H, I)
SPECS = {
    "llama3.2": LLAMA32,
    "llama3.1": LLAMA31,
    "qwen2": QWEN2,
    "phi3": PHI3,
    "deepseek_v3": DEEPSEEK_V3,
    "mixtral": MIXTRAL,
    "mixtral-stacked": MIXTRAL,
    "gemma4": GEMMA4_PLAIN,
    "llama4": LLAMA4,
    "glm4_moe": GLM45,
}


def spawn(target, *args, world: int = 2, timeout: float = 240) -> list[int]:
    """Run target(rank, world, port, *args) in `world` spawned processes; their exit codes."""
    ctx = mp.get_context("spawn")
    port = tp_ranks.free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{model: (single-process figures, [rank 0's, rank 1's], transformers' prefill logits)},
    and "death": (exit codes, (seconds rank 0 took to fail, its error)) once rank 1 died."""
    root = tmp_path_factory.mktemp("tp")
    folders, refs = {}, {}
    for name, spec in SPECS.items():
        folder, ref = make_checkpoint(root / name, spec, rope_key="type", raw=name in RAW)
        if name.endswith("-stacked"):
            assert "model.layers.0.mlp.experts.gate_up_proj" in save_in_memory_names(folder, ref)
        folders[name] = str(folder)
        with torch.no_grad():
            ids = torch.tensor([tp_ranks.PROMPT, tp_ranks.PROMPT[::-1]])
            refs[name] = ref(ids).logits
    out = root / "out"
    out.mkdir()
    codes = spawn(tp_ranks.parity_rank, folders, str(out))
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    death = (out / "rank0.txt").read_text().split("\n", 1)
    one = load_model(folders["llama3.2"], max_seq_len=64, max_batch_size=2)
    rows = (torch.load(out / "rows.pt"), tp_ranks.rows_and_copies(one))
    plain = tp_ranks.speculate(load_model(folders["gemma4"], max_seq_len=64, max_batch_size=2))
    spec = (torch.load(out / "spec.pt"), plain)
    torch.set_num_threads(1)
    return {
        "death": (codes, death),
        "rows": rows,
        "spec": spec,
        **{
            name: (
                tp_ranks.measure(load_model(folder, max_seq_len=64, max_batch_size=2), 1),
                [r[name] for r in ranks],
                refs[name],
            )
            for name, folder in folders.items()
        },
    }


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", list(SPECS))
def test_two_ranks_equal_one_process(runs, name):
    alone, ranks, ref = runs[name]
    for r in ranks:
        assert r["prefill"].shape == alone["prefill"].shape  # the whole vocabulary, gathered
        assert rel(r["prefill"], alone["prefill"]) < 1e-5
        assert rel(r["step"], alone["step"]) < 1e-5
        assert rel(r["prefill"], ref) < 1e-4  # and transformers, for good measure
        assert r["greedy"] == alone["greedy"]


@pytest.mark.parametrize("name", list(SPECS))
def test_ranks_sample_the_same_tokens_with_one_seed(runs, name):
    _, (r0, r1), _ = runs[name]
    assert r0["sampled"] == r1["sampled"]
    assert len(r0["sampled"]) == 8


@pytest.mark.parametrize("name", list(SPECS))
def test_each_rank_holds_at_most_055_of_the_weights(runs, name):
    alone, ranks, _ = runs[name]
    for r in ranks:
        assert r["bytes"] <= 0.55 * alone["bytes"], (r["bytes"], alone["bytes"])


def test_rank_0_driving_carries_the_servers_row_views_and_copies(runs):
    """zoo serve's scheduler narrows the cache to one row for a prefill and copies prefixes
    between rows; with rank 0 driving, rank 1's cache follows: the logits of both rows equal
    the single process's (a copy or a row view lost on rank 1 breaks its half of the sum)."""
    driven, alone = runs["rows"]
    assert driven.shape == alone.shape == (2, 1, LLAMA32["vocab_size"])
    assert rel(driven, alone) < 1e-5


def test_rank_0_driving_speculates_on_sliding_layers(runs):
    """Prompt lookup's rejected drafts are undone in rank 1's rings too: the greedy tokens of
    a speculative run past the window equal a plain single-process run's."""
    (tokens, lps, drafted, accepted), (plain, plain_lps, _, _) = runs["spec"]
    assert 0 < accepted < drafted  # drafts made, some rejected
    assert tokens == plain
    assert lps == pytest.approx(plain_lps, rel=1e-4, abs=1e-5)


def test_a_dead_rank_stops_the_other_within_seconds(runs):
    """After the parity run, rank 1 exits; rank 0's next forward raises at once."""
    codes, (elapsed, message) = runs["death"]
    assert codes == [1, 3]
    assert float(elapsed) < 10, elapsed  # the socket closed: no waiting for the 30 s timeout
    assert message.startswith("DistributedError: rank 0 of 2: a collective failed")
    assert "another rank died" in message


def test_heads_that_do_not_divide_name_the_field_and_the_valid_sizes():
    cfg = LlamaConfig.from_dict(dict(LLAMA32, num_attention_heads=6, head_dim=8)).to_runtime()
    with pytest.raises(ConfigError, match=r"num_attention_heads = 6 .* allows: 1, 2"):
        tp_mod.check(cfg, 4, "config.json")
    cfg = LlamaConfig.from_dict(dict(LLAMA32, num_key_value_heads=4)).to_runtime()
    tp_mod.check(cfg, 4, "config.json")
    cfg = LlamaConfig.from_dict(dict(LLAMA32, intermediate_size=81)).to_runtime()
    with pytest.raises(ConfigError, match=r"intermediate_size = 81 .* allows: 1$"):
        tp_mod.check(cfg, 2, "config.json")


def test_load_model_refuses_a_bad_tp_before_any_process_group(tmp_path):
    folder, _ = make_checkpoint(tmp_path / "m", LLAMA32)
    with pytest.raises(ConfigError, match=r"config.json: tp=3 cannot split num_attention_heads"):
        load_model(folder, tp=3)
    with pytest.raises(ConfigError, match=r"tp=2 needs 2 processes.*`torchrun --nproc-per-node 2"):
        load_model(folder, tp=2)  # no group and no torchrun environment


def test_the_sharding_cuts_fused_and_replicated_tensors():
    """Rank 1 of 2 on a 4-head / 1-KV-head model: q rows of heads 2-3, the one KV head whole;
    q|k|v stored fused (Phi-3) cut into the same three ranges; a row-parallel bias zero."""
    cfg = LlamaConfig.from_dict(dict(LLAMA31, attention_bias=True)).to_runtime()
    s = tp_mod.Sharding(cfg, rank=1, world=2)
    d = 16
    assert s.cut("model.layers.0.self_attn.qkv_proj.weight", "q", (64, 64)).ranges == ((32, 64),)
    assert s.cut("model.layers.0.self_attn.qkv_proj.weight", "k", (d, 64)).ranges == ((0, d),)
    fused = s.cut("model.layers.0.self_attn.qkv_proj.weight", None, (96, 64))
    assert fused.ranges == ((32, 64), (64, 80), (80, 96))
    assert fused.shape((96, 64)) == (64, 64)
    assert s.cut("model.layers.0.self_attn.o_proj.bias", None, (64,)).zero
    assert s.cut("model.layers.0.input_layernorm.weight", None, (64,)) is None
    assert s.cut("lm_head.weight", None, (96, 64)).ranges == ((48, 96),)


def test_config_json_survives_the_local_split():
    """The local config halves heads and sizes, keeping the vocabulary and the head dim."""
    cfg = LlamaConfig.from_dict(json.loads(json.dumps(LLAMA32))).to_runtime()
    local = tp_mod.local_config(cfg, 2)
    a = local.layer_attention(0)
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (2, 1, 16)
    assert local.mlp.intermediate_size == 40 and local.vocab_size == cfg.vocab_size


def test_a_rank_reads_its_slices_through_get_slice(tmp_path, monkeypatch):
    """Rank 1 of 2 on a 4-head / 1-KV-head model: its rows of q, its columns of o, its half of
    the vocabulary, the one KV head whole; sliced tensors never go through a whole read."""
    from safetensors.torch import load_file

    from core.plugins import registry
    from plugins.formats.safetensors import SafetensorsCheckpoint

    folder, _ = make_checkpoint(tmp_path / "m", LLAMA31)
    full = load_file(folder / "model.safetensors")
    cfg = LlamaConfig.from_dict(json.loads((folder / "config.json").read_text())).to_runtime()
    inner = SafetensorsCheckpoint(folder)
    whole = inner.read

    def read(name):
        assert "norm" in name, f"{name} was read whole"  # only replicated tensors
        return whole(name)

    monkeypatch.setattr(inner, "read", read)
    weight_map = registry().architecture("llama", source="test").weight_map
    ckpt = tp_mod.ShardedCheckpoint(inner, weight_map, tp_mod.Sharding(cfg, 1, 2))
    layer = "model.layers.0."
    q, k, o = (layer + f"self_attn.{x}_proj.weight" for x in "qko")
    assert torch.equal(ckpt.read(q), full[q][32:]) and ckpt.shape(q) == (32, 64)
    assert torch.equal(ckpt.read(k), full[k])  # 1 KV head: replicated
    assert torch.equal(ckpt.read(o), full[o][:, 32:]) and ckpt.shape(o) == (64, 32)
    up = layer + "mlp.up_proj.weight"
    assert torch.equal(ckpt.read(up), full[up][40:])
    head = "lm_head.weight"
    assert torch.equal(ckpt.read(head), full[head][48:])
    norm = layer + "input_layernorm.weight"
    assert torch.equal(ckpt.read(norm), full[norm])


def test_a_layer_past_the_model_is_left_whole(tmp_path):
    """A checkpoint with one more layer than the model runs (GLM-4.5's MTP module, which the
    loader skips) splits without asking the config for that layer (an IndexError once)."""
    from safetensors.torch import load_file, save_file

    from core.plugins import registry
    from plugins.formats.safetensors import SafetensorsCheckpoint

    folder, _ = make_checkpoint(tmp_path / "m", LLAMA31)
    path = folder / "model.safetensors"
    full = load_file(path)
    n = LLAMA31["num_hidden_layers"]
    mtp = {k.replace("layers.0.", f"layers.{n}."): v.clone() for k, v in full.items() if ".0." in k}
    save_file({**full, **mtp}, path, metadata={"format": "pt"})
    cfg = LlamaConfig.from_dict(json.loads((folder / "config.json").read_text())).to_runtime()
    weight_map = registry().architecture("llama", source="test").weight_map
    sharding = tp_mod.Sharding(cfg, 1, 2)
    ckpt = tp_mod.ShardedCheckpoint(SafetensorsCheckpoint(folder), weight_map, sharding)
    q = f"model.layers.{n}.self_attn.q_proj.weight"
    assert sharding.cut(q, None, (64, 64)) is None and ckpt.shape(q) == tuple(mtp[q].shape)


def test_a_gguf_rank_dequantizes_then_slices():
    """GGUF has no read_slice: rank 2 of 3 reads SmolLM2's quantized q_proj whole, decodes
    it, keeps its 3 heads' rows (9 heads of 64); down_proj's last third of columns."""
    from core.hub import resolve
    from core.plugins import registry

    path = resolve("smollm2")
    reg = registry()
    inner = reg.format_for(path).open(path)
    try:
        cfg = reg.architecture("llama", source="test").config.from_dict(inner.config()).to_runtime()
        weight_map = reg.architecture("llama", source="test").weight_map
        ckpt = tp_mod.ShardedCheckpoint(inner, weight_map, tp_mod.Sharding(cfg, 2, 3))
        q = "model.layers.0.self_attn.q_proj.weight"
        whole = inner.read(q).float()
        assert whole.shape == (576, 576) and ckpt.shape(q) == (192, 576)
        assert torch.equal(ckpt.read(q).float(), whole[384:])
        down = "model.layers.0.mlp.down_proj.weight"
        assert torch.equal(ckpt.read(down).float(), inner.read(down).float()[:, 1024:])
    finally:
        inner.close()


def test_a_layer_kind_without_a_split_rule_is_refused_by_name():
    """A plugin's own attention kind (or a linear-attention layer) has no split rule."""
    import dataclasses

    class OwnAttentionSpec:
        num_heads = 4

    cfg = LlamaConfig.from_dict(LLAMA32).to_runtime()
    odd = dataclasses.replace(cfg, attention_layers=(cfg.attention, OwnAttentionSpec()))
    with pytest.raises(ConfigError, match=r"layer 1's OwnAttentionSpec is not a kind .* tp=1"):
        tp_mod.check(odd, 2, "config.json")
