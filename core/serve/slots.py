"""The server's rows of the static KV cache (slots), and the prompt prefix each one holds.

Every row of the `StaticKVCache` is a slot that one request holds from admission to its end.
A slot remembers the token ids whose keys and values it holds (`fed`: a prompt and the tokens
fed after it), and keeps them after its request ends, so a new request starts from the longest
prefix of its prompt that any slot holds: a free slot's own, or another slot's copied into a
free one (positions [:n] of each cache tensor). Only what is exact is reused:
- a sliding layer's ring holds a row's last `window` positions, so a slot that has held more
  than that many is not reused at all (its early positions are gone);
- a recurrent layer's state (no position dim) sums up every token fed; no slot is reused.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from core.kv_cache import StaticKVCache


def _grows(spec, seq: int, name: str) -> int | None:
    """The dim of a layer's cache tensor `name` that grows with the cache length (None: a
    fixed-size ring or state)."""
    a, b = spec.cache_layout(1, seq)[name], spec.cache_layout(1, seq + 1)[name]
    return next((d for d, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


class Slots:
    """Which rows are busy, what each holds, and the longest reusable prefix for a prompt."""

    def __init__(self, cache: StaticKVCache, specs: list) -> None:
        self.cache = cache
        n, seq = cache.max_batch_size, cache.max_seq_len
        self.fed: list[list[int]] = [[] for _ in range(n)]  # ids whose K/V the row holds
        self.busy = [False] * n
        self._released = [0] * n  # when each row was last freed (least recent is taken first)
        self._clock = 0
        # per layer, per cache tensor: its position dim, or None (a ring, or a recurrent state)
        self.seq_dims = [
            tuple(_grows(spec, seq, name) for name in names)
            for spec, names in zip(specs, cache.names, strict=True)
        ]
        windows = [getattr(spec, "window", None) for spec in specs]
        # positions every layer keeps of a row (a ring: its last min(window, max_seq_len))
        self.kept = min([w for w in windows if w is not None] + [seq])
        # a layer caching neither positions nor a window: a state of everything fed so far
        self.recurrent = any(
            w is None and None in dims for w, dims in zip(windows, self.seq_dims, strict=True)
        )

    @property
    def free(self) -> list[int]:
        return [r for r, b in enumerate(self.busy) if not b]

    def reusable(self, row: int) -> int:
        """How many of row's held positions a request may start from."""
        n = len(self.fed[row])
        return 0 if self.recurrent or n >= self.kept else n

    def match(self, row: int, ids: list[int]) -> int:
        """Tokens of `ids` that row holds, as a prefix; at most len(ids) - 1 (the last prompt
        token is always fed: its logits give the first new token)."""
        held = self.fed[row][: min(self.reusable(row), len(ids) - 1)]
        n = 0
        for a, b in zip(held, ids, strict=False):
            if a != b:
                break
            n += 1
        return n

    def acquire(self, ids: list[int], reuse: bool = True) -> tuple[int, int]:
        """Take a free row for prompt `ids`: (row, prompt tokens it already holds). The row
        then holds just those tokens; the rest of the prompt is the caller's to prefill."""
        free = self.free
        lru = min(free, key=lambda r: self._released[r])
        own = max(free, key=lambda r: (self.match(r, ids), -self._released[r])) if reuse else lru
        best = max(range(len(self.busy)), key=lambda r: self.match(r, ids)) if reuse else own
        n_own, n_best = self.match(own, ids) if reuse else 0, self.match(best, ids) if reuse else 0
        if n_best > n_own:  # copy the longer prefix into the least recently freed row
            row, n = lru, n_best
            self.copy(best, row, n)
            self.fed[row] = self.fed[best][:n]
        else:
            row, n = own, n_own
            del self.fed[row][n:]
        self.busy[row] = True
        return row, n

    def release(self, row: int) -> None:
        self._clock += 1
        self.busy[row], self._released[row] = False, self._clock

    def forget(self) -> None:
        """Every row's contents unknown (after a failed step): nothing is reused."""
        for fed in self.fed:
            fed.clear()

    def copy(self, src: int, dst: int, n: int) -> None:
        """Make row dst hold row src's first n positions (a ring or a state whole)."""
        for bufs, dims in zip(self.cache.layers, self.seq_dims, strict=True):
            for t, d in zip(bufs, dims, strict=True):
                if d is None:
                    t[dst].copy_(t[src])
                else:  # d counts the batch dim; t[row] has lost it
                    t[dst].narrow(d - 1, 0, n).copy_(t[src].narrow(d - 1, 0, n))

    @contextmanager
    def only(self, row: int) -> Iterator[None]:
        """Within: the cache seen as a batch of one, `row` (views of its buffers, so that a
        forward of one row writes that row in place)."""
        full = self.cache.layers
        self.cache.layers = [tuple(t[row : row + 1] for t in bufs) for bufs in full]
        try:
            yield
        finally:
            self.cache.layers = full
