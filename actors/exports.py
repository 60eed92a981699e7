"""Pages handed to other nodes as Ray objects, shared while they stay recent.

    export(keys) -> [ref, ref, ...]     one object per page, published straight from the slot
    recent:  key -> ref   (LRU within a byte budget, so a hot page that several nodes read
                           is copied into the object store once)

Exports run one at a time: a request that arrives while another exports the same pages finds
them in `recent` when its turn comes, instead of copying them again.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from cluster.core.geometry import PageGeometry
from cluster.core.keys import PageKey
from cluster.core.store import NodeStore

Publish = Callable[[np.ndarray], object]  # bytes of a page -> a handle others can read (ray.put)


class ExportCache:
    """Recently exported pages of one node: key -> published handle, bounded in bytes."""

    def __init__(self, store: NodeStore, budget_bytes: int, publish: Publish):
        self.store = store
        self.budget_bytes = budget_bytes
        self.publish = publish
        self.recent: OrderedDict[PageKey, tuple[object, int]] = OrderedDict()
        self.used_bytes = 0
        self._lock = asyncio.Lock()
        self.counters = {"export_calls": 0, "exported_pages": 0, "export_hits": 0}

    async def export(self, geometry: PageGeometry, keys: list[PageKey]) -> list:
        """Handles to the longest local prefix of `keys`, one per page."""
        async with self._lock:
            self.counters["export_calls"] += 1
            handles = self._cached_prefix(keys)
            if len(handles) < len(keys):
                handles += await self._publish(geometry, keys[len(handles):])
            return handles

    def _cached_prefix(self, keys: list[PageKey]) -> list:
        handles = []
        for key in keys:
            if key not in self.recent:
                break
            self.recent.move_to_end(key)
            handles.append(self.recent[key][0])
        self.counters["export_hits"] += len(handles)
        return handles

    async def _publish(self, geometry: PageGeometry, keys: list[PageKey]) -> list:
        # One copy, from the (pinned) slot into the object store.
        handles = await self.store.map_pages(geometry, keys, self.publish)
        for key, handle in zip(keys, handles, strict=False):
            self._remember(key, handle, geometry.page_bytes)
        self.counters["exported_pages"] += len(handles)
        return handles

    def _remember(self, key: PageKey, handle: object, page_bytes: int) -> None:
        self.recent[key] = (handle, page_bytes)
        self.used_bytes += page_bytes
        while self.used_bytes > self.budget_bytes and self.recent:
            _, (_, old_bytes) = self.recent.popitem(last=False)
            self.used_bytes -= old_bytes
