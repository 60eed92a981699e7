"""Pages handed to other nodes as Ray objects, shared while they stay recent.

    export_pages(keys) -> [ref, ref, ...]     one ray.put per page, straight from the slot
    recent:  key -> ref   (LRU within a byte budget, so a hot page that several nodes read
                           is copied into the object store once)

Exports run one at a time: a request that arrives while another exports the same pages finds
them in `recent` when its turn comes, instead of copying them again.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import ray

from cluster.core.geometry import PageGeometry
from cluster.core.keys import PageKey
from cluster.core.store import NodeStore


class ExportCache:
    """Recently exported pages of one node: key -> ObjectRef, bounded in bytes."""

    def __init__(self, store: NodeStore, budget_bytes: int):
        self.store = store
        self.budget_bytes = budget_bytes
        self.recent: OrderedDict[PageKey, tuple[ray.ObjectRef, int]] = OrderedDict()
        self.used_bytes = 0
        self._lock = asyncio.Lock()
        self.counters = {"export_calls": 0, "exported_pages": 0, "export_hits": 0}

    async def export(self, geometry: PageGeometry, keys: list[PageKey]) -> list[ray.ObjectRef]:
        """Refs to the longest local prefix of `keys`, each page one Ray object."""
        async with self._lock:
            self.counters["export_calls"] += 1
            refs = self._cached_prefix(keys)
            if len(refs) < len(keys):
                refs += await self._put(geometry, keys[len(refs):])
            return refs

    def _cached_prefix(self, keys: list[PageKey]) -> list[ray.ObjectRef]:
        refs = []
        for key in keys:
            if key not in self.recent:
                break
            self.recent.move_to_end(key)
            refs.append(self.recent[key][0])
        self.counters["export_hits"] += len(refs)
        return refs

    async def _put(self, geometry: PageGeometry, keys: list[PageKey]) -> list[ray.ObjectRef]:
        # One copy, from the (pinned) slot into the object store.
        refs = await self.store.map_pages(geometry, keys, ray.put)
        for key, ref in zip(keys, refs, strict=False):
            self._remember(key, ref, geometry.page_bytes)
        self.counters["exported_pages"] += len(refs)
        return refs

    def _remember(self, key: PageKey, ref: ray.ObjectRef, page_bytes: int) -> None:
        self.recent[key] = (ref, page_bytes)
        self.used_bytes += page_bytes
        while self.used_bytes > self.budget_bytes and self.recent:
            _, (_, old_bytes) = self.recent.popitem(last=False)
            self.used_bytes -= old_bytes
