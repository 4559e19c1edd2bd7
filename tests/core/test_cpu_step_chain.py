"""Chains in the fused CPU decode step (core/cpu_step.py, kernels/cpu/decode.c and mla.c): one
call holding several consecutive tokens of a cache row (speculative decoding verifies a row's
drafted tokens so) beside another row's single token gives the logits and cache writes of the
modules' forward over each row's tokens: GQA with and without q/k norms, DeepSeek's MLA, fp32
weights and weights kept in 8-bit and 4-bit blocks, a chain far into an fp16 cache. Models whose
step cannot take a chain (a ring that wraps, a recurrent layer) say so, and a chain at
non-consecutive positions is refused before the C step writes anything."""

from __future__ import annotations

import pytest
import torch
from conftest import make_checkpoint
from fixtures.fused_steps import PROMPTS, deepseek_checkpoint, rel_err

from core import load_model
from kernels.cpu.build import MAX_ROWS, library

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the step is unfused")

BASE = dict(
    model_type="llama",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MLA = dict(
    BASE,
    model_type="deepseek_v3",
    num_key_value_heads=4,
    first_k_dense_replace=2,  # every MLP dense
    q_lora_rank=32,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    rms_norm_eps=1e-6,
)
SPECS = {
    "llama": BASE,  # 2 query heads per kv head
    "qwen3-qk-norm": dict(BASE, model_type="qwen3", head_dim=16),
    "deepseek-v3": MLA,  # the latent cache (mla.c)
    "mistral-window": dict(BASE, model_type="mistral", sliding_window=5, head_dim=None),
    "lfm2": dict(
        BASE,
        model_type="lfm2",
        layer_types=["conv", "full_attention"],
        conv_L_cache=4,
        block_auto_adjust_ff_dim=False,
        norm_eps=1e-5,
    ),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """folder(name) -> SPECS[name]'s checkpoint, written once per module."""
    made: dict[str, object] = {}

    def get(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            if name == "deepseek-v3":
                made[name] = deepseek_checkpoint(root, SPECS[name])
            else:
                made[name] = make_checkpoint(root, SPECS[name])[0]
        return made[name]

    return get


def caches(m) -> list[torch.Tensor]:
    return [t for bufs in m.net.kv_cache.layers for t in bufs]


def prefill(m) -> torch.Tensor:
    """PROMPTS in rows 0 and 1 (of unequal length); their next positions."""
    m.reset()
    ids = torch.zeros(len(PROMPTS), max(map(len, PROMPTS)), dtype=torch.long)
    for r, p in enumerate(PROMPTS):
        ids[r, : len(p)] = torch.tensor(p)
    m.forward(ids, 0, lengths=[len(p) for p in PROMPTS])
    return torch.tensor([len(p) for p in PROMPTS])


# (case, quantize at load, bound): fp32 agrees to rounding; kept blocks as
# test_cpu_step.py's quantized test says (values an ulp apart meet a rounding step of x's blocks)
RUNS = [
    ("llama", None, 1e-5),
    ("qwen3-qk-norm", None, 1e-5),
    ("deepseek-v3", None, 1e-5),
    ("llama", "int8", 5e-4),
    ("deepseek-v3", "int4", 1e-3),
]


@pytest.mark.parametrize(("case", "quantize", "bound"), RUNS)
def test_a_chain_equals_the_modules_forward_of_its_tokens(folder, case, quantize, bound):
    """Row 1's MAX_ROWS - 1 next tokens (a chain, in order, the longest a call takes) and row
    0's next token between them, in one call: each token's logits and the cache afterwards are
    those of the modules' forward of row 1's tokens at once and of row 0's token."""
    m = load_model(folder(case), max_batch_size=2, max_seq_len=64, quantize=quantize,
                   kv_dtype="float32")  # fmt: skip
    start = prefill(m)
    g = torch.Generator().manual_seed(5)
    chain = torch.randint(3, 96, (MAX_ROWS - 1,), generator=g)
    single = torch.tensor([44])
    before = [t.clone() for t in caches(m)]
    with torch.inference_mode():
        want1 = m.net(chain[None], int(start[1]), row=1)[0]  # (MAX_ROWS - 1, vocab)
        want0 = m.net(single[None], int(start[0]), row=0)[0]
        after = [t.clone() for t in caches(m)]
        for t, b in zip(caches(m), before, strict=True):
            t.copy_(b)
        half = len(chain) // 2  # row 0's token in the middle of the chain
        tokens = torch.cat([chain[:half], single, chain[half:]])
        rows = torch.tensor([1] * half + [0] + [1] * (len(chain) - half))
        at = torch.arange(len(chain)) + start[1]
        positions = torch.cat([at[:half], start[:1], at[half:]])
        assert m.step.takes_chain(MAX_ROWS)
        end = int(positions.max()) + 1
        got = m.step(tokens, positions, end, rows=rows)
        assert m.step.fused(tokens, positions, end, rows=rows) is not None  # the C step ran
    assert rel_err(got[rows == 1], want1) < bound
    assert rel_err(got[rows == 0], want0) < bound
    for t, a in zip(caches(m), after, strict=True):
        assert rel_err(t, a) < bound


def test_a_chain_far_into_an_fp16_cache(folder):
    """Row 1 prefilled to position 100 in an fp16 cache, then 8 drafted tokens in one call with
    row 0's next token among them (the chain's tokens read each key and value once, together,
    each as far as its own position): the modules' forward over the same cache, on 2 threads
    and on 3 (4 units of (row, kv head) for 3 threads: each row's tokens go in 3 parts)."""
    m = load_model(folder("llama"), max_batch_size=2, max_seq_len=128, kv_dtype="float16")
    g = torch.Generator().manual_seed(7)
    m.reset()
    m.forward(torch.randint(3, 96, (2, 100), generator=g), 0, lengths=[4, 100])
    chain, single = torch.randint(3, 96, (8,), generator=g), torch.tensor([44])
    before = [t.clone() for t in caches(m)]
    tokens = torch.cat([chain[:3], single, chain[3:]])
    rows = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1, 1])
    positions = torch.tensor([100, 101, 102, 4, 103, 104, 105, 106, 107])
    threads = torch.get_num_threads()
    with torch.inference_mode():
        want1 = m.net(chain[None], 100, row=1)[0]
        want0 = m.net(single[None], 4, row=0)[0]
        try:
            for n in (2, 3):
                torch.set_num_threads(n)
                for t, b in zip(caches(m), before, strict=True):
                    t.copy_(b)
                got = m.step.fused(tokens, positions, 108, rows=rows)
                assert got is not None  # the C step ran
                assert rel_err(got[rows == 1], want1) < 1e-5, n
                assert rel_err(got[rows == 0], want0) < 1e-5, n
        finally:
            torch.set_num_threads(threads)


def test_what_takes_no_chain(folder):
    """A ring that wraps (a window of 5 in a cache of 64) or a recurrent layer (LFM2's short
    conv): no chain, and a row named twice is refused; a window of 5 in a cache of 5 never
    wraps: chains. Non-consecutive positions, more tokens than a call takes: refused."""
    for name, seq, takes in [("mistral-window", 64, False), ("lfm2", 64, False),
                             ("mistral-window", 5, True), ("llama", 64, True)]:  # fmt: skip
        m = load_model(folder(name), max_batch_size=2, max_seq_len=seq)
        assert m.step.takes_chain(2) is takes, name
        assert m.step.takes_chain(MAX_ROWS + 1) is False
        if not takes:
            with pytest.raises(IndexError, match="takes no chains"):
                m.step(torch.tensor([5, 6]), torch.tensor([0, 1]), 2, rows=torch.tensor([1, 1]))
    prefill(m)  # the llama: rows 0 and 1 hold the prompts
    saved = [t.clone() for t in caches(m)]
    for pos in ([3, 7, 5], [3, 7, 3], [4, 7, 3]):  # row 1's: a gap, twice one, out of order
        with pytest.raises(IndexError, match="consecutive positions"):
            m.step(torch.tensor([5, 6, 9]), torch.tensor(pos), 8, rows=torch.tensor([1, 0, 1]))
    assert all(torch.equal(t, s) for t, s in zip(caches(m), saved, strict=True))
