"""The engine's rows of the static KV cache (slots), and the prompt prefix each one holds.

Every row of the cache is a slot that one sequence holds from admission to its end. A slot
remembers the token ids whose keys and values it holds (`fed`: a prompt and the tokens fed
after it), and keeps them after its sequence ends, so a new one may start from the longest
prefix of its prompt that any slot holds: a free slot's own, or another slot's copied into a
free one (the cache's `copy`). Only what is exact is reused:
- a sliding layer's ring holds a row's last `window` positions, so a slot that has held more
  than that many is not reused at all (its early positions are gone);
- a recurrent layer's state (no position dim) sums up every token fed; no slot is reused.
"""

from __future__ import annotations

from collections.abc import Callable


class Slots:
    """Which rows are busy, what each holds, and the longest reusable prefix for a prompt.

    `kept` / `recurrent`: the cache's (`StaticKVCache`); `copy(src, dst, n)` copies a row's
    prefix into another (the network's `copy_rows`, which tensor parallelism mirrors)."""

    def __init__(
        self,
        n: int,
        kept: int,
        recurrent: bool,
        copy: Callable[[int, int, int], None] | None = None,
    ) -> None:
        self.fed: list[list[int]] = [[] for _ in range(n)]  # ids whose K/V the row holds
        self.busy = [False] * n
        self.kept, self.recurrent, self.copy = kept, recurrent, copy
        self._released = [0] * n  # when each row was last freed (least recent is taken first)
        self._clock = 0

    @property
    def free(self) -> list[int]:
        return [r for r, b in enumerate(self.busy) if not b]

    def reusable(self, row: int) -> int:
        """How many of row's held positions a request may start from."""
        n = len(self.fed[row])
        return 0 if self.recurrent or self.copy is None or n >= self.kept else n

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
