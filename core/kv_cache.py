"""The static KV cache: allocated once, written in place, never reallocated.

What a layer caches per token is the attention kind's business: its spec's `cache_layout`
names the tensors (GQA: `k`, `v`; MLA: `latent`, `k_pe`) and their shapes; a sliding GQA layer
asks for `min(window, max_seq_len)` positions (its ring buffer); a recurrent layer (gated
DeltaNet: `conv`, `state`) a fixed-size state per row, which the layer itself starts from zero
for a row whose input begins at position 0 (a reused row needs no reset). A spec may keep a
tensor in another dtype than the model's (`cache_dtypes`: the delta-rule state in fp32). The
cache allocates each layer's own layout and hands a layer its tensors, in that order.

Keys and values may be kept in another dtype than the model computes in (load_model's
`kv_dtype`: fp16 on CPUs for quantized weights, as llama.cpp keeps them); attention reads them
back in the model's dtype. On CPUs the whole cache is one anonymous memory mapping: pages are
zero until written and resident only once written, so a cache sized for the model's whole
context costs memory as the tokens come, and `reset` gives the pages back.

The cache also owns its row operations, which the engine's rows (core/slots.py) and tensor
parallelism call: `row(r)` (the cache seen as a batch of one row, views written in place),
`copy(src, dst, n)` (a prefix of one row into another), and what a row can keep (`kept`
positions; `recurrent`: a state that sums up every token fed, which no prefix can be cut from).

Snapshots make a recurrent row's prefixes reusable all the same: `snapshots` copies per row of
every recurrent tensor of every layer (`snap`: (max_batch_size, snapshots, *the tensor's row
shape), in the same zero-until-written mapping), into which `snapshot(row, slot)` saves the
row's live state and from which `restore(src, slot, dst)` puts one back into a row. Which
position each slot holds is the engine's rows' business (core/slots.py); `snapshot_interval`
is the spacing they take them at.

Speculative decoding (core/speculative.py) feeds a row k + 1 tokens of which only the first
few may be kept: `keep(row, start, n)` saves what a forward over positions start..start+n-1
overwrites beyond those positions (a ring's slots, which hold older positions; a recurrent
row's whole state) and `rewind` puts back what the rejected positions overwrote (a recurrent
state: the state before all n, the caller re-feeds the kept tokens). Full layers keep nothing:
positions past a row's length are never read, and are overwritten as it grows.
"""

from __future__ import annotations

import mmap
from typing import NamedTuple

import torch

from core.config import RuntimeConfig
from core.errors import RequestError

ALIGN = 64  # bytes: each cache tensor starts on a cache line
# Snapshots of a recurrent row's state: 8 per row, every 256 tokens (thinned evenly once full,
# core/slots.py). 256: a snapshot costs one copy of the state, next to 256 tokens of prefill
# (well under 1%), and a resumed prompt re-reads at most that many tokens where snapshots are
# dense; 8: a 2,000-token chat keeps one every 256 tokens, for 8 x the state's memory per row.
SNAPSHOTS, SNAPSHOT_INTERVAL = 8, 256


class StaticKVCache:
    """Per layer, one buffer per cached tensor in the model dtype, allocated once.

    GQA: k, v (max_batch_size, kv_heads, max_seq_len or min(window, max_seq_len), head_dim);
    MLA: latent (max_batch_size, max_seq_len, kv_lora_rank), k_pe (..., qk_rope_head_dim).
    Each layer owns its buffers (not views of one stacked tensor), so a compiled decode step
    writes them in place instead of copying a shared base.
    """

    def __init__(
        self,
        cfg: RuntimeConfig,
        max_batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        snapshots: int = SNAPSHOTS,
        snapshot_interval: int = SNAPSHOT_INTERVAL,
    ):
        if snapshots < 0 or snapshot_interval < 1:  # (before any allocation: a cache kept)
            raise RequestError(
                f"snapshots ({snapshots}) must be 0 (off) or more and snapshot_interval "
                f"({snapshot_interval}) at least 1 token"
            )
        specs = cfg.attention_layers
        layouts = [spec.cache_layout(max_batch_size, max_seq_len) for spec in specs]
        self.names = [tuple(layout) for layout in layouts]  # per layer
        plan = []  # per layer: (shape, dtype) of each tensor
        for spec, layout in zip(specs, layouts, strict=True):
            own = spec.cache_dtypes() if hasattr(spec, "cache_dtypes") else {}
            plan.append([(shape, getattr(torch, own[n]) if n in own else dtype)
                         for n, shape in layout.items()])  # fmt: skip
        # per layer, per tensor: its position dim, or None (a ring, or a recurrent state)
        self.seq_dims = [
            tuple(_grows(spec, max_seq_len, name) for name in names)
            for spec, names in zip(specs, self.names, strict=True)
        ]
        windows = [getattr(spec, "window", None) for spec in specs]
        # per layer, per tensor: a ring's position dim (a sliding layer's slots), or None
        self.ring_dims = [
            tuple(_grows(spec, 1, name) if w is not None and d is None else None
                  for name, d in zip(names, dims, strict=True))
            for spec, w, names, dims in zip(specs, windows, self.names, self.seq_dims, strict=True)
        ]  # fmt: skip
        # per layer, per tensor: whether it is a recurrent state (no position dim, no window)
        states = [
            tuple(w is None and d is None for d in dims)
            for w, dims in zip(windows, self.seq_dims, strict=True)
        ]
        # a layer caching neither positions nor a window: a state of everything fed so far
        self.recurrent = any(any(s) for s in states)
        self.snapshots = snapshots if self.recurrent else 0
        self.snapshot_interval = snapshot_interval
        # each recurrent tensor's snapshots: (max_batch_size, snapshots, *its row shape)
        each = [(shape, dt) for ts, st in zip(plan, states, strict=True)
                for (shape, dt), s in zip(ts, st, strict=True) if s]  # fmt: skip
        plan.append([((max_batch_size, self.snapshots, *shape[1:]), dt)
                     for shape, dt in each if self.snapshots])  # fmt: skip
        self._area: mmap.mmap | None = None
        if torch.device(device).type == "cpu":
            *self.layers, snap = self._mapped(plan)
        else:
            *self.layers, snap = [
                tuple(torch.zeros(shape, dtype=dt, device=device) for shape, dt in ts)
                for ts in plan
            ]
        # (live tensor, its snapshots) of every recurrent tensor
        live = [t for bufs, st in zip(self.layers, states, strict=True)
                for t, s in zip(bufs, st, strict=True) if s]  # fmt: skip
        self.live_states, self._snap = live, snap
        self.states = list(zip(live, snap, strict=True)) if self.snapshots else []
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        # positions every layer keeps of a row (a ring: its last min(window, max_seq_len))
        self.kept = min([w for w in windows if w is not None] + [max_seq_len])
        self._rows: dict[int, RowView] = {}

    def _mapped(self, plan: list) -> list[tuple[torch.Tensor, ...]]:
        """Every tensor of `plan` in one anonymous mapping, zero until written."""
        sizes = [[_nbytes(shape, dt) for shape, dt in ts] for ts in plan]
        total = sum(-(-n // ALIGN) * ALIGN for ns in sizes for n in ns)
        self._area = mmap.mmap(-1, max(total, 1), mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        layers, at = [], 0
        for ts, ns in zip(plan, sizes, strict=True):
            out = []
            for (shape, dt), n in zip(ts, ns, strict=True):
                raw = torch.frombuffer(self._area, dtype=torch.uint8, count=n, offset=at)
                out.append(raw.view(dt).view(shape))
                at += -(-n // ALIGN) * ALIGN
            layers.append(tuple(out))
        return layers

    @property
    def nbytes(self) -> int:
        """Bytes of every row's keys, values and states, snapshots included."""
        return sum(t.nbytes for bufs in self.layers for t in bufs) + self.snapshot_bytes * (
            self.max_batch_size
        )

    @property
    def state_bytes(self) -> int:
        """Bytes of one row's recurrent state (every recurrent tensor of every layer)."""
        return sum(live[0].nbytes for live in self.live_states)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one row's snapshots (all its slots)."""
        return sum(snap[0].nbytes for _, snap in self.states)

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        """Layer i's cache tensors, in the order its attention's forward() takes them."""
        return self.layers[i]

    def row(self, r: int) -> RowView:
        """The cache as a batch of one, row r: a forward given it writes that row in place."""
        if r not in self._rows:
            self._rows[r] = RowView([tuple(t[r : r + 1] for t in bufs) for bufs in self.layers])
        return self._rows[r]

    def copy(self, src: int, dst: int, n: int) -> None:
        """Make row dst hold row src's first n positions (a ring or a state whole)."""
        for bufs, dims in zip(self.layers, self.seq_dims, strict=True):
            for t, d in zip(bufs, dims, strict=True):
                if d is None:
                    t[dst].copy_(t[src])
                else:  # d counts the batch dim; t[row] has lost it
                    t[dst].narrow(d - 1, 0, n).copy_(t[src].narrow(d - 1, 0, n))

    def snapshot(self, row: int, slot: int) -> None:
        """Save row's recurrent state (every recurrent tensor of every layer) into its `slot`."""
        for live, snap in self.states:
            snap[row, slot].copy_(live[row])

    def restore(self, src: int, slot: int, dst: int) -> None:
        """Make row dst's recurrent state the one row src saved in its `slot`."""
        for live, snap in self.states:
            live[dst].copy_(snap[src, slot])

    def hold(self, row: int) -> list[torch.Tensor]:
        """A copy of row's recurrent state, which `put` writes back (across a forward that
        would feed the row a token it must not keep)."""
        return [live[row].clone() for live in self.live_states]

    def put(self, row: int, held: list[torch.Tensor]) -> None:
        for live, t in zip(self.live_states, held, strict=True):
            live[row].copy_(t)

    def keep(self, row: int, start: int, n: int) -> Kept | None:
        """Before a forward of n tokens at positions start.. of `row` that may be cut back: a
        copy of what it overwrites that older positions hold (ring slots; recurrent states).
        None where it overwrites nothing of the kind (full attention only)."""
        rings = []
        for bufs, dims in zip(self.layers, self.ring_dims, strict=True):
            for t, d in zip(bufs, dims, strict=True):
                if d is not None:
                    size = t.shape[d]
                    if n > size:
                        raise ValueError(f"{n} tokens overwrite a ring of {size} slots twice")
                    slots = (torch.arange(start, start + n) % size).to(t.device)
                    rings.append((t[row], d - 1, slots, t[row].index_select(d - 1, slots)))
        states = self.hold(row) if self.recurrent else None
        return Kept(rings, states) if rings or states is not None else None

    def rewind(self, row: int, kept: Kept, n: int) -> bool:
        """After that forward, keep only its first n positions: the slots later ones overwrote
        get their old contents back. True where a recurrent state went back to before the
        forward: the caller feeds the n kept tokens again."""
        for t, d, slots, old in kept.rings:
            t.index_copy_(d, slots[n:], old.narrow(d, n, old.shape[d] - n))
        if kept.states is not None:
            self.put(row, kept.states)
        return kept.states is not None

    def reset(self) -> None:
        """Zero every tensor (on CPUs: the pages go back to the system and read as zeros)."""
        if self._area is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._area.madvise(mmap.MADV_DONTNEED)
            return
        for bufs in [*self.layers, self._snap]:
            for t in bufs:
                t.zero_()


class Kept(NamedTuple):
    """What `StaticKVCache.keep` saved: per ring tensor (the row's view, its position dim,
    the slots written, their old contents), and the row's recurrent state (or None)."""

    rings: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]]
    states: list[torch.Tensor] | None


class RowView:
    """One row of a `StaticKVCache`: each layer's tensors as views of that row (batch of one)."""

    def __init__(self, layers: list[tuple[torch.Tensor, ...]]):
        self.layers = layers

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        return self.layers[i]


def _grows(spec, seq: int, name: str) -> int | None:
    """The dim of a layer's cache tensor `name` that grows with the cache length (None: a
    fixed-size ring or state)."""
    a, b = spec.cache_layout(1, seq)[name], spec.cache_layout(1, seq + 1)[name]
    return next((d for d, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def cache_write(
    cache: torch.Tensor, new: torch.Tensor, start_pos: int | torch.Tensor, end: int, seq_dim: int
) -> torch.Tensor:
    """Write `new` (B, ..., T, ...) into cache rows [:B] at positions start_pos.. along
    `seq_dim` (an int, or a (B,) tensor of per-row positions); return cache[:B] up to `end`,
    the slice attention reads (end >= every row's start_pos + T)."""
    b, t = new.shape[0], new.shape[seq_dim]
    rows = cache[:b]
    if isinstance(start_pos, int):
        rows.narrow(seq_dim, start_pos, t).copy_(new)
    else:
        # One index_put_ on the whole buffer (not on a view of it), which a compiled step
        # keeps in place: index tensors for batch, the dims before seq_dim, and positions,
        # broadcasting to new's leading (B, ..., T) shape.
        def along(values: torch.Tensor, *dims: int) -> torch.Tensor:
            shape = [1] * (seq_dim + 1)
            for d in dims:
                shape[d] = new.shape[d]
            return values.view(shape)

        index = [along(torch.arange(new.shape[d], device=new.device), d) for d in range(seq_dim)]
        pos = start_pos[:, None] + torch.arange(t, device=new.device)  # (B, T)
        index.append(along(pos, 0, seq_dim))
        cache.index_put_(tuple(index), new.to(cache.dtype))
    return rows.narrow(seq_dim, 0, end)


def as_compute(cached: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Cache entries in the dtype the model computes in (`like`'s): a copy where the cache
    keeps another (fp16 keys and values beside fp32 math), else the entries themselves."""
    return cached if cached.dtype == like.dtype else cached.to(like.dtype)
