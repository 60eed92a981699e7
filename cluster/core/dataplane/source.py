"""A page server's source: the node's store, touched only on the node actor's event loop.

The server's connection threads ask the loop to pin pages (run_coroutine_threadsafe) and to
unpin them (call_soon_threadsafe); they read only slot bytes and the shared generation table.
A loop that does not answer within the timeout makes the read a miss; a pin that lands after
its reader gave up is released as soon as it lands.

Only pages of the request's namespace are served (each page's entry knows whose it is): the
server checked the request's tag for that namespace, and a node's request for any namespace
names none.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass

from cluster.core.dataplane.auth import KIND_NODE
from cluster.core.dataplane.server import ServedPages
from cluster.core.dataplane.wire import ReadRequest
from cluster.core.store import NodeStore
from cluster.core.tiers.memory import MappedArena


@dataclass(frozen=True, slots=True)
class _Pin:
    lease_id: int
    slots: tuple[tuple[MappedArena, int, int], ...]  # (arena, slot, generation) per page


class StoreSource:
    """Pins, bytes and generations of a NodeStore's pages, for a PageServer."""

    def __init__(self, store: NodeStore, loop: asyncio.AbstractEventLoop, timeout_s: float):
        self.store = store
        self.loop = loop
        self.timeout_s = timeout_s

    def open(self, request: ReadRequest) -> ServedPages | None:
        future = asyncio.run_coroutine_threadsafe(self._pin(request), self.loop)
        try:
            return future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.add_done_callback(self._release_late)
            return None

    async def _pin(self, request: ReadRequest) -> ServedPages | None:
        if request.geometry not in self.store.pools:  # a geometry this node never held
            return None
        keys = list(request.keys)[: self._owned_prefix(request)]
        if not keys:
            return None
        lease_id, located = await self.store.acquire(request.geometry, keys)
        if not located:
            return None
        pool = self.store.pools[request.geometry]
        page_bytes = request.geometry.page_bytes
        pages = tuple(pool.memory[tier].view(slot)[:page_bytes] for tier, slot, _ in located)
        slots = tuple((pool.memory[tier], slot, gen) for tier, slot, gen in located)
        return ServedPages(pages, _Pin(lease_id, slots))

    def _owned_prefix(self, request: ReadRequest) -> int:
        """How many leading keys are pages of the request's namespace (all, for a node's
        request naming none; none, for a request with no authority)."""
        if request.claim is None:
            return 0
        namespace = request.claim.namespace
        if request.claim.kind == KIND_NODE and not namespace:
            return len(request.keys)
        index = self.store.pools[request.geometry].index
        for position, key in enumerate(request.keys):
            entry = index.get(key)
            if entry is None or entry.namespace != namespace:
                return position
        return len(request.keys)

    def verify(self, served: ServedPages) -> int:
        good = 0
        for arena, slot, generation in served.lease.slots:
            if arena.generation(slot) != generation:
                break
            good += 1
        return good

    def close(self, served: ServedPages) -> None:
        self.loop.call_soon_threadsafe(self.store.release, served.lease.lease_id)

    def _release_late(self, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is None and future.result():
            self.close(future.result())
