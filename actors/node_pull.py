"""How a node copies pages from other nodes into its host tier, through their page servers
(cluster/core/dataplane/): the node actor's `pull`, for prefetches, replication and adoption.

A page already being pulled for another request is awaited, not fetched twice; a dead,
unreachable or silent peer is a miss (its endpoint is looked up afresh next time).
"""

from __future__ import annotations

import asyncio
import logging

import ray

from actors.handles import PeerCache
from cluster.core.claims import InflightClaims
from cluster.core.config import CacheConfig
from cluster.core.dataplane.auth import Authority
from cluster.core.dataplane.endpoint import Endpoint
from cluster.core.dataplane.pull import pull_pages
from cluster.core.geometry import PageGeometry
from cluster.core.keys import PageKey
from cluster.core.store import NodeStore

log = logging.getLogger("raykv.node")


class PagePuller:
    """One node's pulls from its peers. `keys` (peer key, node key) is set once the node has
    its data-plane credentials; `counters["pulled_pages"]` counts what arrived."""

    def __init__(self, config: CacheConfig, store: NodeStore, transport, counters: dict):
        self.config = config
        self.store = store
        self.transport = transport
        self.counters = counters
        self.peers = PeerCache(config)
        self.claims = InflightClaims()
        self.keys: tuple[bytes, bytes] | None = None

    async def pull(self, geometry: PageGeometry, remote: dict[str, list[PageKey]],
                   namespace: str = "") -> int:
        """Copy pages from other nodes (node_id -> keys) that this node lacks; pages pulled."""
        waits, calls = set(), []
        for node_id, keys in remote.items():
            todo, others, done = self.claims.claim(
                k for k in keys if k in self.claims or not self.store.has(geometry, k))
            waits |= others
            calls.append(self._pull_from(node_id, (geometry, todo, namespace), done))
        pulled = await asyncio.gather(*calls)
        await self.claims.wait(waits)
        return sum(pulled)

    async def _pull_from(self, node_id: str, request: tuple[PageGeometry, list[PageKey], str],
                         done: asyncio.Future) -> int:
        keys = request[1]
        try:
            endpoint = await self._endpoint(node_id) if keys else None
            if endpoint is None:
                return 0
            geometry, _, namespace = request
            if not namespace:  # replication: the pages keep their owner's namespace
                namespace = await self._namespace_at(node_id, geometry, keys)
            authority = Authority.of_node(*self.keys, namespace)
            pulled = await pull_pages(self.store, self.transport, endpoint,
                                      (geometry, keys, namespace, authority),
                                      self.config.call_timeout_s)
            if pulled is None:  # unreachable, died or stalled: look it up afresh next time
                self.peers.forget(node_id)
                return 0
            self.counters["pulled_pages"] += pulled
            return pulled
        finally:
            self.claims.finish(keys, done)

    async def _namespace_at(self, node_id: str, geometry: PageGeometry,
                            keys: list[PageKey]) -> str:
        """The namespace of the first of these pages at their owner ("" when it cannot
        say: the pull then asks for pages of any namespace)."""
        peer = await self.peers.aget(node_id)
        try:
            names = await asyncio.wait_for(peer.namespaces(geometry, keys[:1]),
                                           self.config.call_timeout_s) if peer else []
        except (ray.exceptions.RayError, asyncio.TimeoutError) as error:
            log.warning("no namespaces from %s: %s", node_id[:8], error)
            return ""
        return (names[0] or "") if names else ""

    async def _endpoint(self, node_id: str) -> Endpoint | None:
        endpoint = self.peers.endpoint(node_id)
        if endpoint is not None:
            return endpoint
        peer = await self.peers.aget(node_id)
        if peer is None:
            return None
        try:
            endpoint = await asyncio.wait_for(peer.dataplane(), self.config.call_timeout_s)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as error:  # a miss
            log.warning("no data plane endpoint from %s: %s", node_id[:8], error)
            self.peers.forget(node_id)
            return None
        self.peers.remember_endpoint(node_id, endpoint)
        return endpoint
