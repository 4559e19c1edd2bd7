"""zoo-stablelm against transformers' StableLmForCausalLM on tiny random checkpoints (fp32).

Self-contained: needs only zoo, transformers and this package installed (its entry point is how
Zoo finds it).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from zoo_stablelm.config import LayerNormSpec
from zoo_stablelm.layers import LayerNorm

from core import ConfigError, load_model
from core.catalog import named_models
from core.plugins import registry

TOL = 1e-4  # max |error| / max |reference logit|, fp32: the bar every Zoo architecture meets

# stablelm-2-1_6b's shape in miniature: multi-head attention, q/k/v biases, rope on a quarter
# of each head (4 of 16 dims), untied head
STABLELM = dict(
    model_type="stablelm",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    layer_norm_eps=1e-5,
    rope_theta=10000.0,
    partial_rotary_factor=0.25,
    use_qkv_bias=True,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
)
# GQA, no biases, half the head rotated, tied head
STABLELM_GQA = dict(
    STABLELM,
    num_key_value_heads=2,
    use_qkv_bias=False,
    partial_rotary_factor=0.5,
    tie_word_embeddings=True,
)


def make_checkpoint(root, spec: dict, seed: int = 0):
    """A transformers model from `spec`, weights scaled up so a wrong op shows, saved with a
    config.json in the key style of the released StableLM 2 repos (transformers 4 keys)."""
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # LayerNorm weight and bias away from 1 and 0
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(root)
    cfg = json.loads((root / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg.pop("dtype", None)
    cfg.update(
        rope_theta=params["rope_theta"],
        partial_rotary_factor=params["partial_rotary_factor"],
        rope_scaling=None,
        torch_dtype="bfloat16",
    )
    (root / "config.json").write_text(json.dumps(cfg))
    return root, model


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def token_ids(b: int, t: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, STABLELM["vocab_size"], (b, t), generator=gen)


def test_registered_through_the_entry_point():
    reg = registry()
    assert reg.architectures["stablelm"].plugin == "zoo-stablelm:stablelm"
    assert reg.layers[LayerNormSpec].plugin == "zoo-stablelm:stablelm"
    assert reg.layers[LayerNormSpec].module == "zoo_stablelm.layers:LayerNorm"
    assert named_models()["stablelm2-1.6b-chat"]["repo"] == "stabilityai/stablelm-2-1_6b-chat"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_layer_matches_the_transformers_module(dtype):
    ref = torch.nn.LayerNorm(24, eps=1e-5).to(dtype)
    ref.weight.copy_(torch.rand(24) + 0.5)
    ref.bias.copy_(torch.rand(24) - 0.5)
    norm = LayerNorm(24, LayerNormSpec(1e-5)).to(dtype)
    norm.load_state_dict(ref.state_dict())
    x = torch.randn(5, 7, 24).to(dtype)  # odd shapes
    assert torch.equal(norm(x), ref(x))


@pytest.mark.parametrize("spec", [STABLELM, STABLELM_GQA], ids=["mha-bias", "gqa-tied"])
@torch.no_grad()
def test_matches_transformers(tmp_path, spec):
    root, ref = make_checkpoint(tmp_path, spec)
    m = load_model(root, device="cpu", dtype=torch.float32, max_seq_len=64, max_batch_size=2)
    assert type(m.net.model.norm).__name__ == "LayerNorm"  # the plugin's own layer
    assert m.config.rope.dim == int(16 * spec["partial_rotary_factor"])
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
    root, ref = make_checkpoint(tmp_path, STABLELM)
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


@pytest.mark.parametrize("field", ["qk_layernorm", "use_parallel_residual"])
def test_unsupported_variants_are_refused(tmp_path, field):
    root, _ = make_checkpoint(tmp_path, STABLELM)
    cfg = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**cfg, field: True}))
    with pytest.raises(ConfigError, match=field):
        load_model(root, device="cpu")


def test_missing_key_is_named(tmp_path):
    root, _ = make_checkpoint(tmp_path, STABLELM)
    cfg = json.loads((root / "config.json").read_text())
    del cfg["intermediate_size"]
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="intermediate_size"):
        load_model(root, device="cpu")
