"""Thresholded prefix minima: ``min(g[i] for i < k if key[i] >= need[k])`` for every k at once.

The windowed chain DP (``dp.py``) asks, for each end position k of a stage, for the
cheapest reachable start i < k whose stage ``[i, k)`` fits the memory limit. Without
boundary buffers the fitting starts form a window, but the received-input buffers
(the bytes cut at i x in flight, their gradients sent back) make memory non-monotone in i. With parameters
counted once per unit (no parameter shared by two units) the exact stage memory
splits into ``a[k] - b[i]`` (Note [chain DP]), so the test becomes the 2-D dominance
query above with ``key = b`` and ``need = a - limit``.

It is answered offline in O(n log n): ``[0, k)`` is the disjoint union of the blocks
``(k >> l) - 1`` at each level l where bit l of k is set (blocks of ``2**l``
positions). Each block is sorted once by key; a query takes, in each of its blocks,
the prefix minimum of g over the keys that pass. The sort and the query positions
depend only on keys and thresholds, so they are built once and ``query`` (one
gather, one running minimum and one gather per level) runs for every candidate
bottleneck.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ThresholdMin"]


class ThresholdMin:
    """``query(g)[k] = min{g[i] : i < k, key[i] >= need[k]}`` (inf when none), for fixed keys."""

    def __init__(self, key: np.ndarray, need: np.ndarray) -> None:
        key = np.asarray(key, dtype=float)
        need = np.asarray(need, dtype=float)
        assert key.shape == need.shape and key.ndim == 1, "one key and one threshold per position"
        self.size = n = len(key)
        levels = max(1, int(np.ceil(np.log2(max(n, 2)))))
        self.padded = m = 1 << levels
        # Rank keys descending so "key[i] >= need[k]" becomes "rank[i] < passing[k]" on integers.
        values = np.unique(-key)  # ascending -key = descending key
        rank = np.full(m, len(values) + 1, dtype=np.int64)  # padding never passes
        rank[:n] = np.searchsorted(values, -key)
        passing = np.searchsorted(values, -need, side="right")  # ranks 0..passing-1 pass
        width = len(values) + 2
        k = np.arange(n)
        self.plan: list[tuple[np.ndarray, int, np.ndarray, np.ndarray]] = []
        for level in range(levels):
            block = 1 << level
            rows = m // block
            order = np.argsort(rank.reshape(rows, block), axis=1, kind="stable")
            perm = (order + (np.arange(rows) * block)[:, None]).ravel()
            flat = (
                np.repeat(np.arange(rows), block) * width + rank[perm]
            )  # sorted: row-major, rank within
            mine = k[(k >> level) & 1 == 1]
            row = (mine >> level) - 1
            pos = np.searchsorted(flat, row * width + passing[mine], side="left")
            hit = pos > row * block
            self.plan.append((perm, block, mine[hit], pos[hit] - 1))

    def query(self, g: np.ndarray) -> np.ndarray:
        """The thresholded prefix minima of ``g`` (length ``size``; use inf to exclude a position)."""
        assert len(g) == self.size
        padded = np.full(self.padded, np.inf)
        padded[: self.size] = g
        out = np.full(self.size, np.inf)
        for perm, block, ks, at in self.plan:
            running = np.minimum.accumulate(padded[perm].reshape(-1, block), axis=1).ravel()
            out[ks] = np.minimum(out[ks], running[at])  # each k appears once per level
        return out
