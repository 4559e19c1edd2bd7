"""zoo-gemma against transformers' GemmaForCausalLM on tiny random checkpoints (fp32).

Self-contained: needs only zoo, transformers and this package installed (its entry point is how
Zoo finds it).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from zoo_gemma.config import GeGLUSpec, GemmaRMSNormSpec
from zoo_gemma.layers import GeGLU, GemmaRMSNorm

from core import ConfigError, load_model
from core.catalog import named_models
from core.plugins import registry

TOL = 1e-4  # max |error| / max |reference logit|, fp32: the bar every Zoo architecture meets

# gemma-2b's shape in miniature: one kv head, head_dim (16) != hidden / heads (12), tied head
GEMMA = dict(
    model_type="gemma",
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    hidden_act="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
# gemma-7b's: multi-head attention; untied here to cover a separate head
GEMMA_MHA = dict(GEMMA, num_key_value_heads=4, tie_word_embeddings=False)


def make_checkpoint(root, spec: dict, seed: int = 0):
    """A transformers model from `spec`, weights scaled up so a wrong op shows, saved with a
    config.json in the key style of the released Gemma repos."""
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma stores w for (1 + w): keep it away from 0 too
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(root)
    cfg = json.loads((root / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg.pop("dtype", None)
    # the released configs: legacy hidden_act "gelu" plus hidden_activation, transformers 4 keys
    cfg.update(
        rope_theta=params["rope_theta"],
        rope_scaling=None,
        torch_dtype="bfloat16",
        hidden_act="gelu",
        hidden_activation="gelu_pytorch_tanh",
    )
    (root / "config.json").write_text(json.dumps(cfg))
    return root, model


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def token_ids(b: int, t: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, GEMMA["vocab_size"], (b, t), generator=gen)


def test_registered_through_the_entry_point():
    reg = registry()
    assert reg.architectures["gemma"].plugin == "zoo-gemma:gemma"
    assert reg.layers[GemmaRMSNormSpec].plugin == "zoo-gemma:gemma"
    assert reg.layers[GeGLUSpec].module == "zoo_gemma.layers:GeGLU"
    assert named_models()["gemma-2b-it"]["repo"] == "google/gemma-2b-it"  # zoo_register_models


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_layers_match_the_transformers_modules(dtype):
    from transformers.models.gemma import modeling_gemma as tf

    ref_norm = tf.GemmaRMSNorm(24, eps=1e-6).to(dtype)
    ref_norm.weight.copy_(torch.rand(24) - 0.5)
    norm = GemmaRMSNorm(24, GemmaRMSNormSpec(1e-6)).to(dtype)
    norm.weight.copy_(ref_norm.weight)
    x = torch.randn(5, 7, 24).to(dtype)  # odd shapes
    assert torch.equal(norm(x), ref_norm(x))

    config = AutoConfig.for_model("gemma", hidden_size=24, intermediate_size=40)
    ref_mlp = tf.GemmaMLP(config).to(dtype)
    mlp = GeGLU(24, GeGLUSpec(40)).to(dtype)
    gate_up = torch.cat([ref_mlp.gate_proj.weight, ref_mlp.up_proj.weight])
    mlp.gate_up_proj.weight.copy_(gate_up)
    mlp.down_proj.weight.copy_(ref_mlp.down_proj.weight)
    torch.testing.assert_close(mlp(x), ref_mlp(x))  # fused vs two matmuls: rounding only


@pytest.mark.parametrize("spec", [GEMMA, GEMMA_MHA], ids=["mqa-tied", "mha-untied"])
@torch.no_grad()
def test_matches_transformers(tmp_path, spec):
    root, ref = make_checkpoint(tmp_path, spec)
    m = load_model(root, device="cpu", dtype=torch.float32, max_seq_len=64, max_batch_size=2)
    assert type(m.net.model.norm).__name__ == "GemmaRMSNorm"  # the plugin's own layers
    assert type(m.net.model.layers[0].mlp).__name__ == "GeGLU"
    x = token_ids(2, 14)
    want = ref(x).logits
    # prefill
    assert rel_err(m.forward(x), want) < TOL
    # decode: prefill 6 tokens, then one at a time against the full-sequence logits
    m.reset()
    steps = [m.forward(x[:, :6], 0)] + [m.forward(x[:, t : t + 1], t) for t in range(6, 14)]
    assert rel_err(torch.cat(steps, dim=1), want) < TOL
    # a batch of two equals each row alone
    for row in range(2):
        m.reset()
        assert rel_err(m.forward(x[row : row + 1]), want[row : row + 1]) < TOL
    # greedy: 12 tokens identical
    prompt = x[:1, :5]
    greedy = ref.generate(
        prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    m.reset()
    m.eos_token_ids = set()  # transformers was told not to stop; Zoo must not either
    assert m.generate(prompt[0].tolist(), max_new_tokens=12).token_ids == greedy[0, 5:].tolist()


@torch.no_grad()
def test_ragged_batch_matches_transformers(tmp_path):
    """Prompts of unequal length in one batch (right-padded prefill, decode steps at per-row
    positions): each row's logits, then its greedy tokens and their logprobs, are
    transformers' for that row alone."""
    root, ref = make_checkpoint(tmp_path, GEMMA)
    m = load_model(root, device="cpu", dtype=torch.float32, max_seq_len=32, max_batch_size=2)
    rows = [token_ids(1, 12, seed=10)[0], token_ids(1, 12, seed=11)[0]]
    lengths = [5, 9]
    batch = torch.zeros(2, 9, dtype=torch.long)
    for r, n in enumerate(lengths):
        batch[r, :n] = rows[r][:n]
    got = [[logits[:n]] for logits, n in zip(m.forward(batch), lengths, strict=True)]
    for s in range(3):  # three decode steps, each row at its own position
        nxt = torch.stack([row[n + s] for row, n in zip(rows, lengths, strict=True)])
        step = m.forward(nxt[:, None], torch.tensor(lengths) + s)
        for r in range(2):
            got[r].append(step[r])
    for r, n in enumerate(lengths):
        assert rel_err(torch.cat(got[r]), ref(rows[r][None, : n + 3]).logits[0]) < TOL
    # greedy generation of the same prompts as one batch: each new token is transformers'
    # argmax on that row alone, and its logprob is transformers' (log_softmax moves by at
    # most twice the logit error)
    prompts = [row[:n].tolist() for row, n in zip(rows, lengths, strict=True)]
    m.reset()
    greedy = dict(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    for prompt, res in zip(prompts, m.generate(prompts, **greedy), strict=True):
        logits = ref(torch.tensor([prompt + res.token_ids])).logits[0, len(prompt) - 1 : -1]
        assert res.token_ids == logits.argmax(-1).tolist()
        want = logits.log_softmax(-1)[range(4), res.token_ids]
        lps = torch.tensor([lp.logprob for lp in res.logprobs])
        assert (lps - want).abs().max() <= 2 * TOL * logits.abs().max(), (lps, want)


@torch.no_grad()
def test_embedding_scale_is_rounded_to_the_model_dtype(tmp_path):
    root, ref = make_checkpoint(tmp_path, GEMMA)
    m = load_model(root, device="cpu", dtype=torch.bfloat16, max_seq_len=16)
    x = token_ids(1, 8)
    # transformers 5: embedding(ids) * embed_scale.to(weight dtype), scale = sqrt(hidden_size)
    want = ref.to(torch.bfloat16).model.embed_tokens(x)
    got = m.net.model.embed_tokens(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    raw = m.net.model.embed_tokens.weight[x].float()
    unrounded = (raw * GEMMA["hidden_size"] ** 0.5).to(torch.bfloat16)  # sqrt(48) kept in fp32
    assert not torch.equal(got, unrounded)


def test_unknown_activation_is_refused(tmp_path):
    root, _ = make_checkpoint(tmp_path, GEMMA)
    cfg = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**cfg, "hidden_act": "relu"}))
    with pytest.raises(ConfigError, match="hidden_act"):
        load_model(root, device="cpu")
