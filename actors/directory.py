"""DirectoryShard: a thin async Ray shell around one DirectoryIndex shard.

Named `raykv-directory-<i>` in the `raykv` namespace, detached, restarted forever. It applies
node event batches, answers longest-prefix matches in one call, purges nodes whose heartbeats
stop, and mirrors itself to Redis (write-behind) when a URL is configured.

Recovery after a restart: from Redis when configured; otherwise empty. Either way a node whose
state here is missing or stale is answered RESYNC on its next batch (cluster/core/events.py),
so the index is whole again within a heartbeat period.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from cluster.core.config import CacheConfig
from cluster.core.demand import PrefixDemand
from cluster.core.directory_index import APPLIED, DirectoryIndex
from cluster.core.events import EventBatch
from cluster.core.keys import KEY_BYTES
from cluster.core.loops import BackgroundLoops
from cluster.core.persist import RedisMirror, directory_key_prefix
from policies.snapshot import PrefixLoad

log = logging.getLogger("raykv.directory")
REDIS_FLUSH_S = 0.1


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class DirectoryShard:
    """One shard of the global page directory."""

    def __init__(self, config_json: str, shard: int):
        self.config_json = config_json
        self.config = CacheConfig.model_validate_json(config_json)
        self.shard = shard
        self.index = DirectoryIndex()
        self.demand = PrefixDemand()
        self.mirror: RedisMirror | None = None
        if self.config.redis_url:
            prefix = directory_key_prefix(self.config.ray_namespace,
                                          self.config.redis_key_space, shard)
            self.mirror = RedisMirror(self.config.redis_url, prefix)
        self.loops = BackgroundLoops()
        self._started: asyncio.Future | None = None
        self.recovered = {"source": "empty", "locations": 0}
        self.purged_nodes: list[str] = []

    async def ready(self) -> dict:
        """Recover (from Redis when configured) and start the background loops, once."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)
        return {"shard": self.shard, **self.recovered}

    async def _start(self) -> None:
        if self.mirror is not None:
            try:
                locations = await self.mirror.load(self.index)
                self.recovered = {"source": "redis", "locations": locations}
            except Exception as error:  # Redis down at start: serve, catch up later
                log.warning("directory shard %d could not load from Redis: %s", self.shard, error)
                self.mirror.needs_rewrite = True
            self.loops.every("redis", REDIS_FLUSH_S, self._flush_redis)
        now_s = time.monotonic()
        for node_log in self.index.nodes.values():
            node_log.last_seen_s = now_s  # recovered nodes get a full timeout to speak up
        self.loops.every("purge", min(0.5, self.config.node_timeout_s / 4), self._purge)

    async def _flush_redis(self) -> None:
        await self.mirror.flush(self.index)

    async def _purge(self) -> None:
        for node_id in self.index.expired_nodes(time.monotonic(), self.config.node_timeout_s):
            self.drop(node_id, "heartbeat timeout")

    def drop(self, node_id: str, why: str) -> int:
        purged = self.index.drop_node(node_id)
        if self.mirror is not None:
            self.mirror.record_drop(node_id)
        self.purged_nodes.append(node_id)
        log.warning("shard %d purged node %s (%s): %d pages", self.shard, node_id[:8], why,
                    purged)
        return purged

    # ---- node events ---------------------------------------------------------------------

    async def apply(self, batch: EventBatch) -> str:
        await self.ready()
        status = self.index.apply(batch, time.monotonic())
        if self.mirror is not None:
            node_log = self.index.nodes.get(batch.node_id)
            if status == APPLIED:
                self.mirror.record(batch.node_id, batch.changes)
                self.mirror.record_node(batch.node_id, node_log.epoch, node_log.watermark)
            elif node_log is None:  # answered RESYNC: the node's locations were dropped
                self.mirror.record_drop(batch.node_id)
        return status

    async def replace_node(self, batch: EventBatch) -> bool:
        """Install a node's whole inventory for this shard (batch.changes)."""
        await self.ready()
        replaced = self.index.replace_node(batch.node_id, batch.epoch, batch.changes, batch.seq,
                                           time.monotonic())
        if replaced and self.mirror is not None:
            self.mirror.record_drop(batch.node_id)
            self.mirror.record_node(batch.node_id, batch.epoch, batch.seq)
            self.mirror.record(batch.node_id, batch.changes)
        return replaced

    async def drop_node(self, node_id: str) -> int:
        await self.ready()
        return self.drop(node_id, "reported dead") if node_id in self.index.nodes else 0

    # ---- queries -------------------------------------------------------------------------

    async def prefix_runs(self, keys_blob: bytes) -> list[list]:
        """Longest-prefix match of the concatenated 16-byte keys, as runs (see
        DirectoryIndex.prefix_runs)."""
        await self.ready()
        keys = [keys_blob[i : i + KEY_BYTES] for i in range(0, len(keys_blob), KEY_BYTES)]
        runs = self.index.prefix_runs(keys)
        self.demand.record(keys, sum(count for _, count in runs), time.monotonic())
        return runs

    async def record_demand(self, keys_blobs: list[bytes]) -> None:
        """Requests a node served whole without asking for a match (each blob its
        concatenated keys, all found): counted as prefix_runs would have counted them."""
        await self.ready()
        now_s = time.monotonic()
        for blob in keys_blobs:
            keys = [blob[i : i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]
            self.demand.record(keys, len(keys), now_s)

    async def hot_prefixes(self, limit: int) -> list[PrefixLoad]:
        """The prefixes requests asked for most lately (this shard's keys of each), with
        the nodes that hold them: the control loop's snapshot (page_bytes left 0)."""
        await self.ready()
        return [PrefixLoad(key, keys, num_requests, self.index.holders(keys))
                for key, keys, num_requests in self.demand.top(limit)]

    async def get_config(self) -> str:
        return self.config_json

    async def stats(self) -> dict:
        await self.ready()
        redis = None
        if self.mirror is not None:
            redis = {"healthy": self.mirror.healthy, "flushes": self.mirror.num_flushes}
        return {"shard": self.shard, "recovered": self.recovered, "redis": redis,
                "purged_nodes": len(self.purged_nodes), "loops": self.loops.running(),
                **self.demand.stats(),
                "loop_errors": dict(self.loops.errors), **self.index.stats()}

    async def flush_redis(self) -> bool:
        """Write pending state to Redis now (tests and shutdown); False if Redis is down."""
        await self.ready()
        return self.mirror is not None and await self.mirror.flush(self.index)

    async def ping(self) -> int:
        return self.shard
