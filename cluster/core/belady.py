"""Belady's offline optimum for a prefix cache: the most blocks any cache of C blocks can hit.

A request is a chain of block keys (a prompt's pages, root first). It hits the longest prefix
of its chain that the cache holds when it arrives; a cached block past a missing one is no hit.
Between requests an offline cache may keep any C of the blocks it held or just saw.

    next use   of a block after request i: the first later request whose chain holds it
               (NEVER when none does)
    keep       per block, in chain order: a hit renews its next use; a missed block goes in if
               the cache has room, else in place of the cached block with the largest
               (next use, depth), and only if that one is larger than its own (else it is
               bypassed); a block never used again is never kept

Every request that holds a block holds its parent, so a parent's next use is never after its
child's; with depth breaking ties, the block with the largest (next use, depth) has no cached
child. The victim is thus always a leaf and the cache stays closed under prefixes: its hits are
those of plain paging, where Belady's MIN with bypass is optimal (tests/unit/test_belady.py
checks it against a brute force over every possible cache content on small traces).
O(log C) per block.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

Key = Hashable


def next_uses(chains: Sequence[Sequence[Key]]) -> list[list[int]]:
    """next_uses(chains)[i][j]: the index of the next request after i holding chains[i][j],
    or len(chains) (never)."""
    never = len(chains)
    upcoming: dict[Key, int] = {}
    out: list[list[int]] = [[] for _ in chains]
    for i in range(len(chains) - 1, -1, -1):
        out[i] = [upcoming.get(key, never) for key in chains[i]]
        for key in chains[i]:
            upcoming[key] = i
    return out


class _Cache:
    """Cached blocks with their (next use, depth), and a lazy max-heap over them."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.rank: dict[Key, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, int, Key]] = []  # (-next use, -depth, tiebreak, key)
        self._pushes = 0

    def set(self, key: Key, rank: tuple[int, int]) -> None:
        self.rank[key] = rank
        self._pushes += 1
        heapq.heappush(self._heap, (-rank[0], -rank[1], self._pushes, key))

    def worst(self) -> tuple[tuple[int, int], Key]:
        """The cached block with the largest (next use, depth), and that rank."""
        while True:
            neg_use, neg_depth, _, key = self._heap[0]
            rank = (-neg_use, -neg_depth)
            if self.rank.get(key) == rank:
                return rank, key
            heapq.heappop(self._heap)  # stale: renewed or evicted since

    def offer(self, key: Key, rank: tuple[int, int], never: int) -> None:
        """Keep a missed block if it ranks below the worst cached one (or there is room)."""
        if rank[0] >= never or self.capacity_blocks == 0:
            return
        if len(self.rank) < self.capacity_blocks:
            self.set(key, rank)
            return
        worst_rank, worst_key = self.worst()
        if rank < worst_rank:
            del self.rank[worst_key]
            self.set(key, rank)


def belady_hits(chains: Sequence[Sequence[Key]], capacity_blocks: int) -> list[int]:
    """Hit blocks per request under Belady's prefix-closed optimum with `capacity_blocks`."""
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    never = len(chains)
    cache = _Cache(capacity_blocks)
    hits: list[int] = []
    for chain, uses in zip(chains, next_uses(chains), strict=True):
        num_hit = 0
        while num_hit < len(chain) and chain[num_hit] in cache.rank:
            num_hit += 1
        hits.append(num_hit)
        for depth, (key, use) in enumerate(zip(chain, uses, strict=True)):
            if depth < num_hit:
                if use >= never:
                    del cache.rank[key]  # never again: free its room now
                else:
                    cache.set(key, (use, depth))
            elif key not in cache.rank:
                cache.offer(key, (use, depth), never)
    return hits
