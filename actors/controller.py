"""Controller: watches Ray membership and keeps one node actor per kv node.

Nodes that join get an actor; nodes Ray reports dead are purged from every directory shard
(the shards also purge on missed heartbeats, whichever comes first). It catches and logs
every error and never dies: a failed pass is retried on the next tick.
"""

from __future__ import annotations

import asyncio
import logging

import ray

from actors.handles import DirectoryHandle
from actors.placement import dead_nodes, ensure_node_actor, kv_nodes
from cluster.core.config import CacheConfig

log = logging.getLogger("raykv.controller")
MEMBERSHIP_S = 1.0
READY_TIMEOUT_S = 60.0


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Controller:
    """The service's membership loop (and, later, its policy loop)."""

    def __init__(self, config_json: str):
        self.config = CacheConfig.model_validate_json(config_json)
        self.directory = DirectoryHandle.lookup(self.config)
        self.members: dict[str, object] = {}
        self.dropped: set[str] = set()
        self._loop: asyncio.Task | None = None

    async def sync_members(self) -> list[str]:
        """One membership pass now (start() waits on it); starts the loop once."""
        await self._pass()
        if self._loop is None:
            self._loop = asyncio.create_task(self._run())
        return sorted(self.members)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(MEMBERSHIP_S)
            try:
                await self._pass()
            except Exception:
                log.exception("membership pass failed")

    async def _pass(self) -> None:
        nodes = await asyncio.to_thread(ray.nodes)
        for node_id in kv_nodes(self.config, nodes):
            if node_id not in self.members:
                await self._add(node_id)
        for node_id in dead_nodes(nodes) - self.dropped:
            self.members.pop(node_id, None)
            self.dropped.add(node_id)
            await asyncio.gather(*self.directory.drop_node(node_id))

    async def _add(self, node_id: str) -> None:
        actor = ensure_node_actor(self.config, node_id)
        try:
            await asyncio.wait_for(actor.ready.remote(), READY_TIMEOUT_S)
        except Exception as error:  # placement may fail on a node going away: retry later
            log.warning("node actor on %s not ready: %s", node_id[:8], error)
            return
        self.members[node_id] = actor
        log.info("node actor ready on %s", node_id[:8])

    async def stats(self) -> dict:
        return {"members": sorted(self.members), "dropped": sorted(self.dropped)}
