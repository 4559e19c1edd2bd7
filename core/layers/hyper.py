"""Manifold-constrained hyper-connections (DeepSeek V4): a residual of `mult` streams.

Differs from DecoderBlock's pre-norm residual: the hidden state is (B, T, N, D), N streams.
Before each sub-block a `HyperConnection` reads the streams (flattened, RMS-normed without a
weight, one linear map `fn` to 2N + N*N numbers) and gives
  pre  = sigmoid(.) + eps            (N)   the sub-block's input is sum_n pre_n * stream_n
  post = 2 * sigmoid(.)              (N)   how much of the sub-block's output each stream gets
  comb = Sinkhorn(softmax(.) + eps)  (N,N) how the streams mix: new_k = sum_j comb_jk stream_j
all in fp32. After the last block `HyperHead` collapses the streams with its own pre weights.
"""

import torch
import torch.nn.functional as F
from torch import nn

from core.config import RuntimeConfig
from core.config_kinds import HyperConnectionSpec
from core.layers.hash_moe import HashMoE
from core.plugins import registry


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, the mean in fp32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """Streams (B, T, N, D) -> (post (B, T, N), comb (B, T, N, N), collapsed (B, T, D))."""

    def __init__(self, hidden: int, spec: HyperConnectionSpec):
        super().__init__()
        n = spec.mult
        self.spec = spec
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))  # for pre, post, comb
        for p in self.parameters():
            p.keep_fp32 = True

    def forward(self, x: torch.Tensor):
        s, n = self.spec, self.spec.mult
        flat = unweighted_rms_norm(x.flatten(2).float(), s.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre, post, comb = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        scale = self.scale.float()
        pre = torch.sigmoid(pre * scale[0] + pre_b) + s.eps
        post = 2 * torch.sigmoid(post * scale[1] + post_b)
        comb = comb.view(*comb.shape[:-1], n, n) * scale[2] + comb_b.view(n, n)
        comb = torch.softmax(comb, dim=-1) + s.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + s.eps)  # columns first, then rows
        for _ in range(s.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + s.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + s.eps)
        collapsed = (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)
        return post, comb, collapsed


class HyperHead(nn.Module):
    """The last streams (B, T, N, D) -> (B, T, D): sum_n (sigmoid(.) + eps)_n * stream_n."""

    def __init__(self, hidden: int, spec: HyperConnectionSpec):
        super().__init__()
        n = spec.mult
        self.spec = spec
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))
        for p in self.parameters():
            p.keep_fp32 = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        flat = unweighted_rms_norm(x.flatten(2).float(), s.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + s.eps
        return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)


def _merge(post, comb, out, streams):
    """post * out on each stream, plus the streams mixed by comb^T (in the streams' dtype)."""
    dt = streams.dtype
    mixed = torch.matmul(comb.to(dt).transpose(-1, -2), streams)
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class HyperBlock(nn.Module):
    """A decoder block on hyper-connected streams: attention, then the (hash) MoE, each read
    through its HyperConnection and written back through post / comb. Its MLP takes the token
    ids (hash routing); `forward` takes them after DecoderBlock's arguments."""

    takes_ids = True

    def __init__(self, cfg: RuntimeConfig, index: int = 0):
        super().__init__()
        h, hc, layer = cfg.hidden_size, cfg.hyper_connections, registry().layer
        self.input_layernorm = layer(cfg.norm)(h, cfg.norm)
        attn, rope = cfg.layer_attention(index), cfg.layer_rope(index)
        self.self_attn = layer(attn)(h, attn, rope is not None and rope.interleaved)
        self.post_attention_layernorm = layer(cfg.norm)(h, cfg.norm)
        moe = cfg.layer_mlp(index)
        self.mlp = HashMoE(h, moe, cfg.vocab_size, index in moe.hash_layers)
        self.attn_hc = HyperConnection(h, hc)
        self.ffn_hc = HyperConnection(h, hc)
        self.post_norms, self.reduce = False, None  # as DecoderBlock's: neither here

    def forward(self, x, cos, sin, cache, start_pos, end, lengths=None, ids=None):
        """x: the streams (B, T, N, D); ids: the token ids (B, T); the rest as DecoderBlock's."""
        post, comb, c = self.attn_hc(x)
        a = self.self_attn(self.input_layernorm(c), cos, sin, *cache, start_pos, end, lengths)
        x = _merge(post, comb, a, x)
        post, comb, c = self.ffn_hc(x)
        return _merge(post, comb, self.mlp(self.post_attention_layernorm(c), ids), x)
