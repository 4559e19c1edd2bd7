"""DeepSeek sparse attention (DSA: DeepSeek V3.2, GLM-5): MLA whose queries each read only the
`index_topk` earlier keys a lightning indexer ranks highest.

The indexer is a small attention of its own: index_heads query heads from MLA's low-rank q_a,
one key per token (cached beside the latent: `index_k`), relu'd dot products weighted per head
by the token itself. Its top-k per query becomes a mask on MLA's scores, so the attention is
the dense absorbed MLA over the latent cache with the unselected keys masked out. Parameter
names are the hub's (`self_attn.indexer.wq_b`, ...), so the weight map is the identity here.

Differs from the reference DeepSeek code (as transformers does): no Hadamard rotation of q
and k (orthogonal: dot products unchanged) and no fp8 scoring, the scores are fp32.
"""

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from core.config_kinds import SparseMLASpec
from core.kv_cache import as_compute, cache_write
from core.layers.linear import Linear
from core.layers.mla import MLAAttention


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (the indexer's k_norm), in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class Indexer(nn.Module):
    """The lightning indexer: which cached keys each query of this step may attend to."""

    def __init__(self, hidden: int, spec: SparseMLASpec):
        super().__init__()
        self.spec = spec
        h, d = spec.index_heads, spec.index_head_dim
        self.wq_b = Linear(spec.q_lora_rank, h * d, bias=False)
        self.wk = Linear(hidden, d, bias=False)
        self.k_norm = LayerNorm(d)
        self.weights_proj = Linear(hidden, h, bias=False)
        # run in fp32 from fp32 inputs, as transformers keeps it: not quantized
        self.weights_proj.quantizable = False

    def forward(
        self,
        x: torch.Tensor,  # (B, T, hidden)
        q_in: torch.Tensor,  # (B, T, q_lora_rank): MLA's normed q_a
        cos: torch.Tensor,
        sin: torch.Tensor,
        index_cache: torch.Tensor,  # (B_max, S_max, D), written in place
        start_pos: int | torch.Tensor,
        end: int,
    ) -> torch.Tensor:
        """(B, T, end) bool: the keys each query keeps (its top-k visible ones)."""
        b, t, _ = x.shape
        s = self.spec
        q = self.wq_b(q_in).view(b, t, s.index_heads, s.index_head_dim).transpose(1, 2)
        k = self.k_norm(self.wk(x))[:, None]  # (B, 1, T, D)
        # rope on the first qk_rope_head_dim dims of q and k, in the indexer's own layout
        q, k = kernels.apply_rope(q, k, cos, sin, s.index_rope_interleaved)
        keys = as_compute(cache_write(index_cache, k[:, 0], start_pos, end, seq_dim=1), x)
        scores = torch.einsum("bhtd,bsd->bhts", q.float(), keys.float()) * s.index_head_dim**-0.5
        w = F.linear(x.float(), self.weights_proj.weight.float()) * s.index_heads**-0.5
        index = torch.einsum("bth,bhts->bts", w, F.relu(scores))  # (B, T, S)
        visible = causal(start_pos, t, index.shape[-1], x.device)
        index = index.masked_fill(~visible, float("-inf"))
        top = index.topk(min(s.index_topk, index.shape[-1]), dim=-1).indices
        # a query with fewer visible keys than top-k also picked invisible ones: drop them
        chosen = torch.zeros(index.shape, dtype=torch.bool, device=x.device)
        return chosen.scatter_(-1, top, True) & visible


def causal(start_pos: int | torch.Tensor, t: int, s: int, device) -> torch.Tensor:
    """(B or 1, T, S) bool: query i (at start_pos + i) sees cache positions <= its own."""
    if isinstance(start_pos, int):
        start_pos = torch.tensor([start_pos], device=device)
    pos_q = start_pos.to(device).view(-1, 1, 1) + torch.arange(t, device=device)[:, None]
    return torch.arange(s, device=device) <= pos_q


class SparseMLAAttention(MLAAttention):
    """MLA restricted to each query's top-k keys, chosen by this layer's indexer or, with
    `shared_selection`, by the last indexer layer before it (`selection_from`)."""

    def __init__(self, hidden: int, spec: SparseMLASpec, rope_interleaved: bool = True):
        super().__init__(hidden, spec, rope_interleaved)
        if spec.q_lora_rank is None:
            raise ValueError("SparseMLASpec: the indexer reads q_a; q_lora_rank must be set")
        self.indexer = None if spec.shared_selection else Indexer(hidden, spec)
        # this forward's selection, (B, T, S) booleans, kept for the layers that share it until
        # the last of them has read it (a prefill's would otherwise stay, one per layer)
        self.selected: torch.Tensor | None = None
        # plain lists, not submodules (no parameters twice): the indexer layer this one reads;
        # the layers reading this one's, in order
        self._source: list[SparseMLAAttention] = []
        self._readers: list[SparseMLAAttention] = []

    def selection_from(self, earlier: list[nn.Module]) -> None:
        """A sharing layer reads the selection of the last indexer layer in `earlier`."""
        if self.indexer is not None:
            return
        owners = [m for m in earlier if getattr(m, "indexer", None) is not None]
        if not owners:
            raise ValueError("SparseMLASpec: a shared_selection layer has no indexer before it")
        self._source = [owners[-1]]
        owners[-1]._readers.append(self)

    def forward(self, x, cos, sin, *cache_and_positions):
        """(x, cos, sin, latent, k_pe[, index_k], start_pos, end, lengths): layers with an
        indexer have its key cache after MLA's two (SparseMLASpec.cache_layout)."""
        *cache, start_pos, end, _ = cache_and_positions  # (lengths: full layers need none)
        q_in = self._query_input(x)
        q_lat, q_pe, latents, k_pes = self._attention_inputs(
            x, q_in, cos, sin, cache[0], cache[1], start_pos, end
        )
        if self.indexer is not None:
            keep = self.indexer(x, q_in, cos, sin, cache[2], start_pos, end)
            self.selected = keep if self._readers else None
        else:
            source = self._source[0]
            keep = source.selected
            if source._readers[-1] is self:  # its last reader: let the selection go
                source.selected = None
        o_lat = kernels.sparse_mla_attention(
            q_lat, q_pe, latents, k_pes, start_pos, self.spec.scale, keep
        )
        return self._output(o_lat)
