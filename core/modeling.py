"""The generic decoder: blocks and a causal LM assembled from a `RuntimeConfig`.

Parameter names follow the hub's Llama layout (`model.layers.N.self_attn.qkv_proj.weight`),
so an architecture's weight map only lists where its checkpoint differs. Every module (token
embedding, norms, attention, MLP) is built from the type of its spec, through the layer kinds
the plugins registered (`zoo_register_layers`; the core's own in plugins/core_layers.py).
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

import kernels
from core.config import RuntimeConfig
from core.config_kinds import NoSubBlock
from core.errors import ZooError
from core.kv_cache import SNAPSHOT_INTERVAL, SNAPSHOTS, StaticKVCache
from core.layers import LMHead, RotaryEmbedding
from core.layers.per_layer import PerLayerEmbeddings
from core.plugins import registry


class KernelError(ZooError, kernels.KernelError):
    """A kernel's refusal (ZOO_KERNELS=triton where Triton cannot run, an unknown ZOO_KERNELS,
    bad kernel inputs) as the core reports it: a ZooError, and still a kernels.KernelError."""


@contextmanager
def kernel_errors() -> Iterator[None]:
    """Re-raise a kernels.KernelError inside as the core's KernelError (same message): the
    kernels know nothing of ZooError; users, the CLI and the server catch that."""
    try:
        yield
    except kernels.KernelError as err:
        if isinstance(err, ZooError):
            raise
        raise KernelError(str(err)) from err


def build(spec: Any, *args: Any) -> nn.Module:
    """The module registered for `type(spec)`, built as `Module(*args, spec, ...)`:

    embedding (vocab, hidden, spec); norm and mlp (hidden, spec); attention (hidden, spec,
    rope_interleaved), its forward taking (x, cos, sin, *its cache tensors, start_pos, end,
    lengths) with cos = sin = None on a layer without rope.
    """
    return registry().layer(spec)(*args)


class DecoderBlock(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h)), each sub-block's output
    times `cfg.residual_scale` first (Granite's residual_multiplier; 1 elsewhere). With
    `post_norms` each sub-block's output is normed too before its residual add (Gemma 2 / 3):
    h = x + norm(attn(norm(x))); out = h + norm(mlp(norm(h))). Without `pre_norms` (OLMo 2 / 3)
    only the outputs are normed: h = x + norm(attn(x)); out = h + norm(mlp(h)). Gemma 4 then
    adds the layer's per-layer input (`cfg.per_layer_input`) and multiplies by a learned
    `layer_scalar`. A `NoSubBlock` layer spec drops that sub-block and its norm (Nemotron-H:
    out = x + mixer(input_layernorm(x)), the mixer attention or MLP)."""

    def __init__(self, cfg: RuntimeConfig, index: int = 0):
        super().__init__()
        h = cfg.hidden_size
        self.pre_norms = cfg.pre_norms
        attn, rope = cfg.layer_attention(index), cfg.layer_rope(index)
        mlp = cfg.layer_mlp(index)
        # a NoSubBlock (Nemotron-H's one-mixer layers): neither that sub-block nor its norm;
        # the one sub-block left is normed by input_layernorm
        self.self_attn = self.mlp = None
        if cfg.pre_norms:
            self.input_layernorm = build(cfg.norm, h, cfg.norm)
        if not isinstance(attn, NoSubBlock):
            self.self_attn = build(attn, h, attn, rope is not None and rope.interleaved)
        if cfg.pre_norms and not isinstance(attn, NoSubBlock) and not isinstance(mlp, NoSubBlock):
            self.post_attention_layernorm = build(cfg.norm, h, cfg.norm)
        if not isinstance(mlp, NoSubBlock):
            self.mlp = build(mlp, h, mlp)
        elif cfg.post_norms or cfg.per_layer_input is not None or cfg.layer_scalar:
            # (forward returns after the attention: these would be skipped without a word)
            raise ValueError(
                f"layer {index}: a block without an MLP takes no post-norms, per-layer inputs "
                "nor layer scalar"
            )
        self.post_norms = cfg.post_norms
        # tensor parallelism (core/parallel/tp.py): sums the attention's and the MLP's partial
        # outputs (this rank's heads / intermediate rows) over the ranks; None on one rank
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        if cfg.post_norms:  # the hub's post_attention_layernorm / post_feedforward_layernorm
            self.attn_out_layernorm = build(cfg.norm, h, cfg.norm)
            self.post_feedforward_layernorm = build(cfg.norm, h, cfg.norm)
        # Gemma 4: this block adds its per-layer input after the MLP, and scales its output
        self.per_layer_input = None
        if cfg.per_layer_input is not None:
            self.per_layer_input = build(cfg.per_layer_input, h, cfg.per_layer_input)
        self.layer_scalar = nn.Parameter(torch.ones(1)) if cfg.layer_scalar else None
        self.residual_scale = cfg.residual_scale  # Granite: each sub-block's output times this

    def forward(
        self,
        x,
        cos,
        sin,
        cache: tuple[torch.Tensor, ...],
        start_pos,
        end: int,
        lengths=None,
        per_layer: torch.Tensor | None = None,
        shared: list | None = None,
    ):
        """`cache`: this layer's cache tensors, as its attention kind lays them out;
        `start_pos`: an int or per-row (B,) positions; `end`: max(start_pos) + T; `lengths`:
        None, or (B,) real tokens per row of a right-padded prefill. `per_layer`: this layer's
        per-layer input (B, T, dim), Gemma 4; `shared`: the K/V this layer hands to later
        layers or reads from an earlier one (GQAAttention's `shared`), None if neither."""
        more = {} if shared is None else {"shared": shared}
        if shared is not None and not cache:  # a kv_source layer: no cache tensors of its own
            cache = (None, None)
        h = x
        if self.self_attn is not None:
            h = self._attention(x, cos, sin, cache, start_pos, end, lengths, more)
        if self.mlp is None:
            return h  # (NoSubBlock layers have no post norms, per-layer inputs nor scalar)
        pre = "post_attention_layernorm" if self.self_attn is not None else "input_layernorm"
        m = getattr(self, pre)(h) if self.pre_norms else h
        # an MLP kind that also reads the un-normed stream (Gemma 4's DenseMoE: its router)
        m = self.mlp(m, h) if getattr(self.mlp, "residual_input", False) else self.mlp(m)
        if self.reduce is not None:
            m = self.reduce(m)
        if self.residual_scale != 1.0:
            m = m * self.residual_scale
        out = h + (self.post_feedforward_layernorm(m) if self.post_norms else m)
        if self.per_layer_input is not None:
            out = self.per_layer_input(out, per_layer)
        return out if self.layer_scalar is None else out * self.layer_scalar

    def _attention(self, x, cos, sin, cache, start_pos, end, lengths, more) -> torch.Tensor:
        """h = x + attn(norm(x)) (the attention's output normed too with post_norms)."""
        a = self.input_layernorm(x) if self.pre_norms else x
        a = self.self_attn(a, cos, sin, *cache, start_pos, end, lengths, **more)
        if self.reduce is not None:
            a = self.reduce(a)
        if self.residual_scale != 1.0:
            a = a * self.residual_scale
        return x + (self.attn_out_layernorm(a) if self.post_norms else a)


class IgnoredNames:
    """Checkpoint names expected but not loaded: exact names, and whole layers by index
    (multi-token-prediction layers stored past the last decoder layer)."""

    def __init__(self, names: set[str], layers: range = range(0)):
        self.names, self.layers = names, layers

    def __contains__(self, name: object) -> bool:
        if name in self.names:
            return True
        parts = str(name).split(".")
        return (
            parts[:2] == ["model", "layers"]
            and len(parts) > 2
            and parts[2].isascii()
            and parts[2].isdigit()
            and int(parts[2]) in self.layers
        )


class Decoder(nn.Module):
    def __init__(self, cfg: RuntimeConfig):
        super().__init__()
        e = cfg.embedding
        self.embed_tokens = build(e, cfg.vocab_size, cfg.hidden_size, e)
        block = DecoderBlock
        if cfg.hyper_connections is not None:  # DeepSeek V4: streams, not one residual
            from core.layers.hyper import HyperBlock, HyperHead

            block = HyperBlock
            self.hc_head = HyperHead(cfg.hidden_size, cfg.hyper_connections)
        self.layers = nn.ModuleList(block(cfg, i) for i in range(cfg.num_layers))
        # a layer reusing an earlier one's work (GLM-5's shared DSA top-k) is told the earlier ones
        for i, block in enumerate(self.layers):
            if hasattr(block.self_attn, "selection_from"):
                block.self_attn.selection_from([b.self_attn for b in self.layers[:i]])
        self.norm = build(cfg.norm, cfg.hidden_size, cfg.norm)
        self.per_layer_embed = None  # Gemma 4's per-layer inputs, made once per forward
        if cfg.per_layer_input is not None:
            self.per_layer_embed = PerLayerEmbeddings(
                cfg.hidden_size, cfg.num_layers, cfg.per_layer_input
            )


class CausalLM(nn.Module):
    """Token ids -> logits. Build on the meta device, load weights, then `setup_caches`."""

    def __init__(self, cfg: RuntimeConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, tied_to=tied)
        self.kv_cache: StaticKVCache | None = None
        # the checkpoint's MTP layer (core/mtp.py `MTPNetwork`), set once loaded where
        # speculative decoding runs it; its cache rows follow this cache's (setup, copies)
        self.mtp: nn.Module | None = None
        # tensor parallelism's rank 0 (core/parallel/distributed.py `Lead`): tells the other
        # ranks of each forward and row copy before running it; None on one rank
        self.lead = None
        self.rotary: RotaryEmbedding | None = None  # the model's rope (cfg.rope)
        self.rotaries = nn.ModuleList()  # one per distinct rope among the layers
        ropes = [cfg.layer_rope(i) for i in range(cfg.num_layers)]
        self.rope_specs = list(dict.fromkeys(r for r in ropes if r is not None))
        self.rope_of_layer = [None if r is None else self.rope_specs.index(r) for r in ropes]
        # K/V handed between layers (GQASpec.kv_source): per layer, the layer whose list it
        # appends to or reads (its own index for a source); None: neither
        sources = {getattr(a, "kv_source", None) for a in cfg.attention_layers} - {None}
        self.kv_lists = [
            i if i in sources else getattr(a, "kv_source", None)
            for i, a in enumerate(cfg.attention_layers)
        ]

    def ignored_checkpoint_names(self) -> IgnoredNames:
        """Checkpoint tensors that are expected but not loaded: a tied head's copy, MTP layers,
        the K/V projections and norms of layers that read another layer's K/V."""
        cfg = self.config
        names = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        for i, spec in enumerate(cfg.attention_layers):  # checkpoints may keep their unused K/V
            if getattr(spec, "kv_source", None) is not None:
                part = f"model.layers.{i}.self_attn"
                names |= {f"{part}.{m}.weight" for m in ("k_proj", "v_proj", "k_norm", "v_norm")}
        return IgnoredNames(names, range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers))

    def setup_caches(
        self,
        max_batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype | None = None,
        snapshots: int = SNAPSHOTS,
        snapshot_interval: int = SNAPSHOT_INTERVAL,
    ) -> None:
        """Allocate the KV cache (in `dtype`, by default the weights'; `snapshots` of each
        recurrent row's state, every `snapshot_interval` tokens) and the rope table on the
        weights' device."""
        w = self.model.embed_tokens.weight
        self.kv_cache = StaticKVCache(
            self.config, max_batch_size, max_seq_len, dtype or w.dtype, w.device,
            snapshots, snapshot_interval,
        )  # fmt: skip
        self.rotary = RotaryEmbedding(self.config.rope, max_seq_len, w.device)
        self.rotaries = nn.ModuleList(
            self.rotary if r == self.config.rope else RotaryEmbedding(r, max_seq_len, w.device)
            for r in self.rope_specs
        )
        if self.mtp is not None:
            self.mtp.setup_caches(max_batch_size, max_seq_len, dtype or w.dtype, w.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        start_pos: int | torch.Tensor = 0,
        end: int | None = None,
        logits_at: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        row: int | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T) at positions start_pos.. -> logits (B, T, vocab); fills the cache.

        start_pos: one int for the batch, or a (B,) tensor of per-row positions (rows of
        unequal length decoding together). end: how much of the cache attention reads, at least
        max(start_pos) + T; by default exactly that, which costs a host sync for tensor
        positions (a compiled decode step passes a bucket instead). logits_at: (B,) indices
        into T; only those rows of the LM head are computed, and logits are (B, 1, vocab).
        lengths: (B,) real tokens per row of a right-padded input_ids; sliding layers then keep
        no padding in their ring buffers (full layers never read past a row's position, so
        they need none). None: every row is T tokens.
        row: run a batch of one on that row of the cache (the server's rows); None: rows [:B].
        """
        if self.lead is not None:
            with self.lead.forward(input_ids, start_pos, end, logits_at, lengths, row):
                return self.run(input_ids, start_pos, end, logits_at, lengths, row)
        return self.run(input_ids, start_pos, end, logits_at, lengths, row)

    def run(self, input_ids, start_pos=0, end=None, logits_at=None, lengths=None, row=None):
        """`forward` on this rank alone (what a tensor-parallel follower replays)."""
        x = self.blocks(input_ids, start_pos, end, lengths, row)
        if logits_at is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logits_at][:, None]
        return self.head(x)

    def hidden(self, input_ids, lengths=None, row=None) -> torch.Tensor:
        """input_ids (B, T) from position 0 -> the final hidden states (B, T, hidden): the
        blocks and the final norm, no LM head (transformers' `last_hidden_state`), for
        embeddings. Fills the cache rows it runs on, as a prefill does (`row`, `lengths`: as
        `forward`'s). One rank only: tensor-parallel followers replay `forward`, not this."""
        if self.lead is not None:
            raise ZooError("hidden states (embeddings) are not available with tensor parallelism")
        return self.model.norm(self.blocks(input_ids, 0, None, lengths, row))

    def blocks(self, input_ids, start_pos=0, end=None, lengths=None, row=None) -> torch.Tensor:
        """The embedding and every decoder block (as `forward`) -> (B, T, hidden), unnormed."""
        t = input_ids.shape[1]
        if isinstance(start_pos, torch.Tensor):
            start_pos = start_pos.to(input_ids.device)
            if end is None:
                end = int(start_pos.max()) + t  # the one host sync of a step
        elif end is None:
            end = start_pos + t
        cache = self.kv_cache if row is None else self.kv_cache.row(row)
        x = self.model.embed_tokens(input_ids)
        hc = self.config.hyper_connections
        if hc is not None:  # every stream starts as the embedding: (B, T, N, hidden)
            x = x.unsqueeze(2).expand(-1, -1, hc.mult, -1).contiguous()
        per_layer = None
        if self.model.per_layer_embed is not None:
            per_layer = self.model.per_layer_embed(input_ids, x)  # (B, T, layers, dim)
        tables = [rotary(start_pos, t, end, lengths) for rotary in self.rotaries]
        shared: dict[int, list] = {}
        for i, layer in enumerate(self.model.layers):
            j, k = self.rope_of_layer[i], self.kv_lists[i]
            cos, sin = (None, None) if j is None else tables[j]
            more = {} if k is None else {"shared": shared.setdefault(k, [])}
            if per_layer is not None:
                more["per_layer"] = per_layer[:, :, i]
            if getattr(layer, "takes_ids", False):  # hash routing (DeepSeek V4)
                more["ids"] = input_ids
            x = layer(x, cos, sin, cache.layer(i), start_pos, end, lengths, **more)
        return x if hc is None else self.model.hc_head(x)

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """Row dst of the cache takes row src's first n positions (on every rank)."""
        if self.lead is not None:
            self.lead.copy(src, dst, n)
        self.kv_cache.copy(src, dst, n)
        if self.mtp is not None:
            self.mtp.copy_rows(src, dst, n)

    def keep_row(self, row: int, start: int, n: int):
        """`StaticKVCache.keep` of row (on every rank): what a verify of n tokens overwrites."""
        kept = self.kv_cache.keep(row, start, n)
        if kept is not None and self.lead is not None:  # (the same on every rank: its layers)
            self.lead.keep(row, start, n)
        return kept

    def rewind_row(self, row: int, kept, n: int) -> bool:
        """`StaticKVCache.rewind` of row to the first n positions `kept` followed (every rank)."""
        if self.lead is not None:
            self.lead.rewind(row, n)
        return self.kv_cache.rewind(row, kept, n)

    # Recurrent rows' snapshots (core/kv_cache.py): one rank only, as tensor parallelism
    # refuses recurrent layers; here beside copy_rows so that every row op goes through the net.
    def snapshot_row(self, row: int, slot: int) -> None:
        """Save row's recurrent state into its snapshot `slot`."""
        self.kv_cache.snapshot(row, slot)

    def restore_row(self, src: int, slot: int, dst: int) -> None:
        """Row dst's recurrent state becomes the one row src saved in its `slot`."""
        self.kv_cache.restore(src, slot, dst)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The last blocks' output (B, T, hidden) -> logits: final norm, LM head, scale, cap."""
        return self.scale_logits(self.lm_head(self.model.norm(x)))

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's output times the config's logits scale, then soft-capped."""
        scale, cap = self.config.logits_scale, self.config.final_softcap
        if scale != 1.0:
            logits = logits * scale
        return logits if cap is None else cap * torch.tanh(logits / cap)
