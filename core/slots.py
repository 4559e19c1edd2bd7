"""The engine's rows of the static KV cache (slots), and the prompt prefix each one holds.

Every row of the cache is a slot that one sequence holds from admission to its end. A slot
remembers the token ids whose keys and values it holds (`fed`: a prompt and the tokens fed
after it), and keeps them after its sequence ends, so a new one may start from the longest
prefix of its prompt that any slot holds: a free slot's own, or another slot's copied into a
free one (the network's `copy_rows`). Only what is exact is reused:
- a sliding layer's ring holds a row's last `window` positions, so a slot that has held more
  than that many is not reused at all (its early positions are gone);
- a recurrent layer's state (no position dim) sums up every token fed, so it cannot be cut
  back: a row resumes at the end of everything it fed (its live state, while `live`: no
  decode step fed it a placeholder since), or at a snapshot of its state (core/kv_cache.py)
  within the shared prefix, put back into the live state (`restore_row`). Snapshots are taken
  as a row's length crosses a multiple of its `stride` (the cache's snapshot interval); once a
  row's slots are full, every other one is dropped and the stride doubles (thinned evenly: any
  point of a history of L tokens has a snapshot at most max(interval, 2 L / snapshots) tokens
  before it, for the start of a shared system prompt as for the end of a chat's last turn).
  Snapshots past the point a row is rewritten from are dropped.
"""

from __future__ import annotations


class Slots:
    """Which rows are busy, what each holds, and the longest reusable prefix for a prompt.

    `kept` / `recurrent`: the cache's (`StaticKVCache`); `net`: the row ops (`copy_rows`,
    `snapshot_row`, `restore_row`, which go through the network as tensor parallelism needs);
    None: nothing is reused. `snapshots` per row, every `interval` tokens."""

    def __init__(
        self,
        n: int,
        kept: int,
        recurrent: bool,
        net=None,
        snapshots: int = 0,
        interval: int = 256,
    ) -> None:
        self.fed: list[list[int]] = [[] for _ in range(n)]  # ids whose K/V the row holds
        self.busy = [False] * n
        self.kept, self.recurrent, self.net = kept, recurrent, net
        self.snapshots, self.interval = snapshots, interval
        self.live = [True] * n  # a recurrent row's state is that of all of fed
        self.snaps: list[dict[int, int]] = [{} for _ in range(n)]  # per row: position -> slot
        self.stride = [interval] * n  # a row's snapshots are at multiples of its stride
        self._released = [0] * n  # when each row was last freed (least recent is taken first)
        self._clock = 0

    @classmethod
    def of(cls, net, rows: int) -> Slots:
        """Slots for `rows` rows of `net`'s cache (none: a forward without a cache of its own,
        tests' references; nothing is reused)."""
        cache = getattr(net, "kv_cache", None)
        if cache is None:
            return cls(rows, rows, False)
        snaps = (cache.snapshots, cache.snapshot_interval)
        return cls(rows, cache.kept, cache.recurrent, net, *snaps)

    @property
    def free(self) -> list[int]:
        return [r for r, b in enumerate(self.busy) if not b]

    def match(self, row: int, ids: list[int]) -> int:
        """Tokens of `ids` that row holds as a prefix and a prompt may resume after; at most
        len(ids) - 1 (the last prompt token is always fed: its logits give the first token)."""
        fed = self.fed[row]
        if self.net is None or len(fed) >= self.kept:
            return 0
        n = shared_prefix(fed, ids[:-1])
        if not self.recurrent or (n == len(fed) and self.live[row]):
            return n
        return max((p for p in self.snaps[row] if p <= n), default=0)

    def acquire(
        self, ids: list[int], reuse: bool = True, row: int | None = None
    ) -> tuple[int, int]:
        """Take a free row for prompt `ids`: (row, prompt tokens it already holds). The row
        then holds just those tokens (a recurrent row: their state); the rest of the prompt is
        the caller's to prefill. `row`: that free row, from position 0 (reusing nothing)."""
        free = self.free
        lru = min(free, key=lambda r: self._released[r]) if row is None else row
        reuse = reuse and row is None
        own = max(free, key=lambda r: (self.match(r, ids), -self._released[r])) if reuse else lru
        best = max(range(len(self.busy)), key=lambda r: self.match(r, ids)) if reuse else own
        n_own, n_best = self.match(own, ids) if reuse else 0, self.match(best, ids) if reuse else 0
        if n_best > n_own:  # copy the longer prefix into the least recently freed row
            row, n = lru, n_best
            self.net.copy_rows(best, row, n)  # K/V of positions < n, live states whole
            self._state_at(best, row, n)
            self.fed[row], self.snaps[row] = self.fed[best][:n], {}
        else:
            row, n = own, n_own
            self._state_at(row, row, n)
            del self.fed[row][n:]
            self.snaps[row] = {p: s for p, s in self.snaps[row].items() if p <= n}
        if not self.snaps[row]:
            self.stride[row] = self.interval
        self.live[row], self.busy[row] = True, True
        return row, n

    def _state_at(self, src: int, dst: int, n: int) -> None:
        """Row dst's recurrent state: src's after its first n tokens (its live one, or the
        snapshot at n; n = 0: none, the layers start a row at position 0 from zeros)."""
        if self.recurrent and n > 0 and not (n == len(self.fed[src]) and self.live[src]):
            self.net.restore_row(src, self.snaps[src][n], dst)

    def feed(self, row: int, ids: list[int], snap: bool) -> None:
        """Row's state now includes `ids`; where `snap` and its length has reached a multiple
        of its stride, snapshot it."""
        fed = self.fed[row]
        fed.extend(ids)
        if snap and self.snapshots and fed and len(fed) % self.stride[row] == 0:
            self._snapshot(row, len(fed))

    def due(self, row: int) -> int | None:
        """The next length at which row takes a snapshot (None: it takes none)."""
        if not self.snapshots:
            return None
        return (len(self.fed[row]) // self.stride[row] + 1) * self.stride[row]

    def _snapshot(self, row: int, p: int) -> None:
        snaps = self.snaps[row]
        while len(snaps) >= self.snapshots:  # full: keep every other one, at twice the stride
            self.stride[row] *= 2
            for q in [q for q in snaps if q % self.stride[row]]:
                del snaps[q]
        if p % self.stride[row] == 0:
            slot = min(set(range(self.snapshots)) - set(snaps.values()))
            self.net.snapshot_row(row, slot)
            snaps[p] = slot

    def touched(self, row: int) -> None:
        """Row's live state took a token it does not hold (a decode step's placeholder): only
        its snapshots can be resumed from now."""
        if self.recurrent:
            self.live[row] = False

    def release(self, row: int) -> None:
        self._clock += 1
        self.busy[row], self._released[row] = False, self._clock

    def reusable(self, ids: list[int]) -> bool:
        """Whether some row holds a prefix of `ids` that a prompt may resume after."""
        return any(self.match(r, ids) for r in range(len(self.busy)))

    def forget(self) -> None:
        """Every row's contents unknown (after a failed step, or a write outside the engine):
        nothing is reused."""
        for fed, snaps in zip(self.fed, self.snaps, strict=True):
            fed.clear()
            snaps.clear()


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens a and b share from the start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
