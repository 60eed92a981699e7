"""PrefixDemand: which prefixes requests ask for, bounded and decayed (one directory shard's).

Each longest-prefix match tells it the keys matched:

    record(keys, num_matched, now_s)
        entry[deepest matched key] += 1            created with its chain (the matched keys)
        every tracked entry on the matched chain += 1
                                                   (a shared system prompt counts every
                                                    conversation that runs through it)

    entry:  prefix_id -> chain (keys, root first), num_requests (cumulative), score

`num_requests` is exact while the entry is tracked: rates come from its differences
(policies/burst.py). `score` decays with `half_life_s` and only chooses who leaves: when the
tracker is full, the quarter of entries with the lowest score goes, so one-off prefixes churn
among themselves while a hot one stays. Scores are kept as log2 of sum(2 ** (t_i / half_life)),
comparable across entries at any time without touching them all.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from cluster.core.keys import PageKey

MAX_CHAIN_KEYS = 1024  # keys kept per entry: a longer prefix is tracked by its first pages


@dataclass(slots=True)
class Demand:
    keys: tuple[PageKey, ...]
    num_requests: int = 0
    log_score: float = -math.inf


class PrefixDemand:
    """A bounded, decayed tracker of the prefixes requests matched (see module docstring)."""

    def __init__(self, max_entries: int = 512, half_life_s: float = 10.0):
        assert max_entries >= 4, "max_entries must be at least 4"
        self.max_entries = max_entries
        self.half_life_s = half_life_s
        self.entries: dict[PageKey, Demand] = {}
        self.num_evicted = 0

    def record(self, keys: list[PageKey], num_matched: int, now_s: float) -> None:
        """One request matched `keys[:num_matched]`."""
        if num_matched <= 0:
            return
        chain = keys[: min(num_matched, MAX_CHAIN_KEYS)]
        deepest = chain[-1]
        weight = now_s / self.half_life_s
        entries = self.entries
        for key in chain[:-1]:
            entry = entries.get(key)
            if entry is not None:
                self._count(entry, weight)
        entry = entries.get(deepest)
        if entry is None:
            if len(entries) >= self.max_entries:
                self._evict()
            entry = entries[deepest] = Demand(tuple(chain))
        self._count(entry, weight)

    @staticmethod
    def _count(entry: Demand, weight: float) -> None:
        entry.num_requests += 1
        high, low = max(entry.log_score, weight), min(entry.log_score, weight)
        entry.log_score = high + math.log2(1.0 + 2.0 ** (low - high))

    def _evict(self) -> None:
        """Drop the lowest-scored quarter (amortised O(log n) per new entry)."""
        num_drop = max(1, len(self.entries) // 4)
        for key in heapq.nsmallest(num_drop, self.entries,
                                   key=lambda k: self.entries[k].log_score):
            del self.entries[key]
        self.num_evicted += num_drop

    def top(self, limit: int) -> list[tuple[PageKey, tuple[PageKey, ...], int]]:
        """Up to `limit` entries, highest recent demand first: (prefix_id, keys, requests)."""
        # heapq.nlargest(limit, items, key=score) is sorted(..., reverse=True)[:limit] (ties
        # keep the entries' order); sorting indices by a list of scores keeps the key in C.
        items = list(self.entries.items())
        scores = [entry.log_score for _, entry in items]
        best = sorted(range(len(items)), key=scores.__getitem__, reverse=True)[:limit]
        return [(items[i][0], items[i][1].keys, items[i][1].num_requests) for i in best]

    def stats(self) -> dict:
        return {"tracked_prefixes": len(self.entries), "evicted_prefixes": self.num_evicted}
