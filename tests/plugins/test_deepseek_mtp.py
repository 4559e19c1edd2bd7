"""The multi-token-prediction layer of DeepSeek V3 and GLM-4.5 (core/mtp.py) and drafting with it
(core/spec_mtp.py) on tiny hub-style checkpoints whose MTP layer holds random weights of its own.

transformers skips the layer, and DeepSeek's inference code drops it (inference/convert.py), so
the reference is written here from its published description (DeepSeek-V3 technical report
section 2.2, README_WEIGHTS.md) in the concatenation order of the code that runs the released
weights (vLLM's deepseek_mtp.py and glm4_moe_mtp.py, SGLang's deepseek_nextn.py:
`eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])`), with transformers' own decoder layer of the
family as the layer.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from parity import rel_err
from safetensors.torch import load_file, save_file
from test_deepseek import make_deepseek
from test_glm4_moe import GLM45, make_glm

from core import ConfigError, load_model
from core.speculative import SpecConfig, make_speculator

N = 3  # the tiny models' num_hidden_layers: their MTP layer is model.layers.3
PROMPTS = [[0, 5, 17, 3, 99, 42, 8], [0, 77, 12, 12, 64]]


def randomize_mtp(root) -> None:
    """Give the MTP layer weights of its own (the helper copies the last decoder layer's and
    writes unit norms and a zero projection): each tensor times (1 + 0.5 noise), eh_proj
    random, the embedding and head copies equal to the model's (as DeepSeek's are)."""
    path = root / "model.safetensors"
    state, g = load_file(path), torch.Generator().manual_seed(3)
    for name in [n for n in state if n.startswith(f"model.layers.{N}.")]:
        t = state[name]
        state[name] = t * (1 + 0.5 * torch.randn(t.shape, generator=g))
    h = state["model.embed_tokens.weight"].shape[1]
    state[f"model.layers.{N}.eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) / h**0.5
    for norm in ("enorm", "hnorm", "shared_head.norm"):  # (the helper wrote ones: now 1 + noise)
        state[f"model.layers.{N}.{norm}.weight"] = 1 + 0.3 * torch.randn(h, generator=g)
    state[f"model.layers.{N}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state[f"model.layers.{N}.shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})


class ReferenceMTP:
    """The MTP layer from the checkpoint's tensors: transformers' decoder layer of the family
    at index N (an MoE layer, as V3's and GLM-4.5's are), its RMSNorms, eh_proj, head copy."""

    def __init__(self, ref, root):
        if ref.config.model_type == "glm4_moe":
            from transformers.models.glm4_moe.modeling_glm4_moe import (
                Glm4MoeDecoderLayer as Layer,
            )
            from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRMSNorm as Norm
        else:
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
                DeepseekV3DecoderLayer as Layer,
            )
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
                DeepseekV3RMSNorm as Norm,
            )

        cfg, self.ref = ref.config, ref
        own = {
            n[len(f"model.layers.{N}.") :]: t
            for n, t in load_file(root / "model.safetensors").items()
            if n.startswith(f"model.layers.{N}.")
        }
        self.block = Layer(cfg, N).eval()
        extra = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
        layer = {k: v for k, v in own.items() if not k.startswith(extra)}
        self.block.load_state_dict(stacked(layer, cfg.n_routed_experts))
        assert self.block.mlp.gate.e_score_correction_bias.abs().sum() > 0
        self.norms = {}
        for name in ("enorm", "hnorm", "shared_head.norm"):
            self.norms[name] = Norm(cfg.hidden_size, cfg.rms_norm_eps)
            self.norms[name].weight.data.copy_(own[f"{name}.weight"])
        self.eh_proj, self.embed = own["eh_proj.weight"], own["embed_tokens.weight"]
        self.head = own["shared_head.head.weight"]

    @torch.no_grad()
    def hidden(self, ids: list[int]) -> torch.Tensor:
        """The target's last-layer outputs (before the final norm) of ids from position 0."""
        got = []
        hook = self.ref.model.layers[-1].register_forward_hook(lambda m, a, out: got.append(out))
        self.ref(torch.tensor([ids]))
        hook.remove()
        return got[0][0]

    @torch.no_grad()
    def __call__(self, nxt: list[int], h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens t_{i+1} and hidden h_i (T, H) at positions 0.. -> (y (T, H), logits (T, V))."""
        e = self.norms["enorm"](self.embed[torch.tensor(nxt)])
        x = (torch.cat([e, self.norms["hnorm"](h)], dim=-1) @ self.eh_proj.T)[None]
        t = x.shape[1]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        rope = self.ref.model.rotary_emb(x, pos)
        y = self.block(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)[0]
        return y, self.norms["shared_head.norm"](y) @ self.head.T


def stacked(own: dict, experts: int) -> dict:
    """Per-expert checkpoint tensors as transformers 5 keeps them: gate_up (E, 2I, H), down."""
    out = {k: v for k, v in own.items() if not re.match(r"mlp\.experts\.\d+\.", k)}
    gate_up = [torch.cat([own[f"mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up")])
               for e in range(experts)]  # fmt: skip
    out["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    out["mlp.experts.down_proj"] = torch.stack(
        [own[f"mlp.experts.{e}.down_proj.weight"] for e in range(experts)]
    )
    return out


def checkpoint(family: str, root):
    """(folder, transformers model) of a tiny DeepSeek V3 or GLM-4.5 with an MTP layer."""
    if family == "glm-4.5":
        return make_glm(root, GLM45, mtp=1)
    return make_deepseek(root, "v3", mtp_layers=1)


@pytest.fixture(scope="module", params=["v3", "glm-4.5"])
def built(request, tmp_path_factory):
    """(checkpoint folder, transformers model, reference MTP, the model without speculation,
    the model with its MTP layer), per family."""
    root, ref = checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    randomize_mtp(root)
    kw = dict(dtype="float32", device="cpu", max_seq_len=64, max_batch_size=2)
    plain, spec = load_model(root, **kw), load_model(root, speculative="mtp", **kw)
    return root, ref, ReferenceMTP(ref, root), plain, spec


def test_mtp_logits_match_reference(built):
    _, _, mtp_ref, _, model = built
    ids = PROMPTS[0] + [23, 61, 2, 90]
    h_ref = mtp_ref.hidden(ids)
    y_ref, ref_logits = mtp_ref(ids[1:], h_ref[:-1])
    with torch.inference_mode():
        h = model.net.blocks(torch.tensor([ids]), 0, row=0)[0]
        y, logits = model.speculator.proposer.run(0, ids[1:], h[:-1], 0)
    model.forget()
    assert rel_err(h, h_ref) < 1e-4
    assert rel_err(logits, ref_logits) < 1e-4, rel_err(logits, ref_logits)
    assert rel_err(y, y_ref) < 1e-4


def reference_drafts(mtp_ref, toks: list[int], pos: int, k: int) -> list[torch.Tensor]:
    """The reference's logits of each of k drafts from a sequence whose positions < pos were
    fed and toks[pos] is next: the layer over every position, then again on its own output."""
    h = mtp_ref.hidden(toks[:pos])
    nxt, out = list(toks[1 : pos + 1]), []
    for _ in range(k):
        y, logits = mtp_ref(nxt, h)
        out.append(logits[-1])
        nxt.append(int(logits[-1].argmax()))
        h = torch.cat([h, y[-1:]])
    return out


def test_greedy_mtp_same_tokens_and_drafts_match_reference(built):
    """Greedy decoding with MTP drafts gives plain greedy's tokens; the drafts the proposer
    made in the engine (prefill, verifies, rejected positions overwritten; 3 tokens a step,
    fewer near max_new_tokens) are the reference's greedy drafts from the sequence so far."""
    *_, mtp_ref, plain, spec = built
    k = 3
    spec.speculator = make_speculator(SpecConfig(method="mtp", k=k, adaptive=False), spec)
    proposer, made = spec.speculator.proposer, []
    propose = proposer.propose

    def recording(seq, n):
        draft = propose(seq, n)
        made.append((seq.ids + seq.out, seq.pos, n, draft.tokens, seq.cached))
        return draft

    proposer.propose = recording
    want = [plain.generate(p, max_new_tokens=12, temperature=0.0).token_ids for p in PROMPTS]
    for prompt, tokens in zip(PROMPTS, want, strict=True):
        got = spec.generate(prompt, max_new_tokens=12, temperature=0.0)
        assert got.token_ids == tokens
        assert got.speculation is not None and got.speculation.draft_tokens > 0
    batch = spec.generate(PROMPTS, max_new_tokens=12, temperature=0.0)  # two rows at once
    assert [r.token_ids for r in batch] == want
    assert made and all(len(d) == n for *_, n, d, _ in made)
    assert spec.speculator.cost.plain_s is not None  # (its last steps, undrafted, timed as plain)
    # a prompt resumed from a prefix a row holds was not fed: its MTP entries there are what
    # the row holds (stale at its end), so only the prompts fed whole are checked
    made = [m[:4] for m in made if m[4] == 0]
    assert max(n for *_, n, _ in made) == k and min(n for *_, n, _ in made) < k  # (at the end)
    for toks, pos, n, draft in made[:4] + made[-2:]:
        for logits, d in zip(reference_drafts(mtp_ref, toks, pos, n), draft, strict=True):
            assert float(logits.max() - logits[d]) <= 1e-4 * float(logits.abs().max())


def test_mtp_less_load_ignores_its_weights(built):
    *_, plain, spec = built
    assert plain.net.mtp is None and plain.speculator is None
    assert not any(".layers.3." in n for n, _ in plain.net.named_parameters())
    assert spec.net.mtp is not None


def test_sampling_and_row_copies(built):
    """Sampling drafts greedily (the engine's rejection rule takes a one-hot proposal); a row
    copy (prefix reuse from another row) copies the MTP cache's row with the main cache's."""
    spec = built[-1]
    out = spec.generate(PROMPTS[0], max_new_tokens=8, temperature=0.9, seed=5)
    assert len(out.token_ids) == 8 and out.speculation.draft_tokens > 0
    cache = spec.net.mtp.kv_cache
    spec.net.copy_rows(0, 1, 5)
    for t, d in zip(cache.layer(0), cache.seq_dims[0], strict=True):  # d: the position dim
        held = t[0].narrow(d - 1, 0, 5)
        assert torch.equal(t[1].narrow(d - 1, 0, 5), held) and held.abs().sum() > 0
    spec.forget()


def test_checkpoint_without_mtp_refused_by_name(built, tmp_path):
    root = built[0]
    cfg = json.loads((root / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    (tmp_path / "model.safetensors").symlink_to(root / "model.safetensors")
    with pytest.raises(
        ConfigError,
        match=r"config\.json.*(deepseek_v3|glm4_moe).*no multi-token.*ngram.*--spec ngram.*--draft",
    ):
        load_model(tmp_path, speculative="mtp", dtype="float32", device="cpu")
    stripped = tmp_path / "stripped"  # MTP declared, its tensors gone (a stripped copy)
    stripped.mkdir()
    (stripped / "config.json").write_text(json.dumps(cfg))
    state = load_file(root / "model.safetensors")
    own = {k: v for k, v in state.items() if not k.startswith(f"model.layers.{N}.")}
    save_file(own, stripped / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"declares 1 MTP layer.*no model\.layers\.3\.\*"):
        load_model(stripped, speculative="mtp", dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match=r"tp=2.*ngram"):
        load_model(root, speculative="mtp", tp=2, dtype="float32", device="cpu")
