"""DeepSeek V3's multi-token-prediction layer (core/mtp.py) and drafting with it
(core/spec_mtp.py) on a tiny hub-style checkpoint whose MTP layer holds random weights of its own.

transformers skips the layer, and DeepSeek's inference code drops it (inference/convert.py), so
the reference is written here from its published description (DeepSeek-V3 technical report
section 2.2, README_WEIGHTS.md) in the concatenation order of the code that runs the released
weights (vLLM's deepseek_mtp.py, SGLang's deepseek_nextn.py: `eh_proj([enorm(embed(t_{i+1}));
hnorm(h_i)])`), with transformers' own DeepseekV3DecoderLayer as the layer.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from parity import rel_err
from safetensors.torch import load_file, save_file
from test_deepseek import make_deepseek

from core import ConfigError, load_model
from core.speculative import SpecConfig, make_speculator

N = 3  # the tiny V3's num_hidden_layers: its MTP layer is model.layers.3
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
    """The MTP layer from the checkpoint's tensors: transformers' decoder layer at index N
    (an MoE layer, as V3's is), its RMSNorms, eh_proj and the head copy."""

    def __init__(self, ref, root):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        cfg, self.ref = ref.config, ref
        own = {
            n[len(f"model.layers.{N}.") :]: t
            for n, t in load_file(root / "model.safetensors").items()
            if n.startswith(f"model.layers.{N}.")
        }
        self.block = DeepseekV3DecoderLayer(cfg, N).eval()
        self.block.load_state_dict(stacked(own, cfg.n_routed_experts), strict=False)
        assert self.block.mlp.gate.e_score_correction_bias.abs().sum() > 0
        self.norms = {}
        for name in ("enorm", "hnorm", "shared_head.norm"):
            self.norms[name] = DeepseekV3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
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


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """(checkpoint folder, transformers model, reference MTP)."""
    root, ref = make_deepseek(tmp_path_factory.mktemp("v3mtp"), "v3", mtp_layers=1)
    randomize_mtp(root)
    return root, ref, ReferenceMTP(ref, root)


@pytest.fixture(scope="module")
def loaded(v3):
    """(the model without speculation, the model with its MTP layer)."""
    root = v3[0]
    kw = dict(dtype="float32", device="cpu", max_seq_len=64)
    return load_model(root, **kw), load_model(root, speculative="mtp", **kw)


def test_mtp_logits_match_reference(v3, loaded):
    _, _, mtp_ref = v3
    model = loaded[1]
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


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_mtp_same_tokens_and_drafts_match_reference(v3, loaded, k):
    """Greedy decoding with MTP drafts gives plain greedy's tokens; every draft the proposer
    made in the engine (prefill, verifies, rejected positions overwritten) is the reference's
    greedy draft from the whole sequence so far."""
    plain, spec = loaded
    spec.speculator = make_speculator(SpecConfig(method="mtp", k=k, adaptive=False), spec)
    proposer, made = spec.speculator.proposer, []
    propose = proposer.propose

    def recording(seq, n):
        draft = propose(seq, n)
        made.append((seq.ids + seq.out, seq.pos, n, draft.tokens))
        return draft

    proposer.propose = recording
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=12, temperature=0.0)
        got = spec.generate(prompt, max_new_tokens=12, temperature=0.0)
        assert got.token_ids == want.token_ids
        assert got.speculation is not None and got.speculation.draft_tokens > 0
    assert made and all(len(d) == n for *_, n, d in made) and max(n for *_, n, _ in made) == k
    for toks, pos, n, draft in made[:6]:
        for logits, d in zip(reference_drafts(v3[2], toks, pos, n), draft, strict=True):
            assert float(logits.max() - logits[d]) <= 1e-4 * float(logits.abs().max())


def test_mtp_less_load_ignores_its_weights(loaded):
    plain, spec = loaded
    assert plain.net.mtp is None and plain.speculator is None
    assert not any(".layers.3." in n for n, _ in plain.net.named_parameters())
    assert spec.net.mtp is not None


def test_checkpoint_without_mtp_refused_by_name(v3, tmp_path):
    root = v3[0]
    cfg = json.loads((root / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    (tmp_path / "model.safetensors").symlink_to(root / "model.safetensors")
    with pytest.raises(ConfigError, match=r"config\.json.*deepseek_v3.*no multi-token.*ngram"):
        load_model(tmp_path, speculative="mtp", dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match=r"tp=2.*ngram"):
        load_model(root, speculative="mtp", tp=2, dtype="float32", device="cpu")
