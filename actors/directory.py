"""DirectoryShard: a thin async Ray shell around one DirectoryIndex shard.

Named `raykv-directory-<i>` in the `raykv` namespace, detached, restarted forever. It applies
node event batches, answers longest-prefix matches in one call, purges nodes whose heartbeats
stop, and mirrors itself to Redis (write-behind) when a URL is configured.

Recovery after a restart: from Redis when configured; otherwise empty, and every node's next
heartbeat is answered RESYNC, so the nodes send their inventories within a heartbeat period.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from cluster.core.config import CacheConfig
from cluster.core.directory_index import APPLIED, DirectoryIndex
from cluster.core.keys import KEY_BYTES, PageKey
from cluster.core.persist import RedisMirror

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
        self.mirror: RedisMirror | None = None
        if self.config.redis_url:
            prefix = f"raykv:{self.config.ray_namespace}:dir{shard}"
            self.mirror = RedisMirror(self.config.redis_url, prefix)
        self._started: asyncio.Task | None = None
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
            asyncio.create_task(self._redis_loop())
        now_s = time.monotonic()
        for node_log in self.index.nodes.values():
            node_log.last_seen_s = now_s  # recovered nodes get a full timeout to speak up
        asyncio.create_task(self._purge_loop())

    async def _redis_loop(self) -> None:
        while True:
            await asyncio.sleep(REDIS_FLUSH_S)
            try:
                await self.mirror.flush(self.index)
            except Exception:
                log.exception("redis flush failed")

    async def _purge_loop(self) -> None:
        period_s = min(0.5, self.config.node_timeout_s / 4)
        while True:
            await asyncio.sleep(period_s)
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

    async def apply(self, node_id: str, epoch: int, seq: int,
                    changes: list[tuple[PageKey, int | None]]) -> str:
        await self.ready()
        status = self.index.apply(node_id, epoch, seq, changes, time.monotonic())
        if status == APPLIED and self.mirror is not None:
            self.mirror.record(node_id, changes)
            node_log = self.index.nodes[node_id]
            self.mirror.record_node(node_id, node_log.epoch, node_log.watermark)
        return status

    async def replace_node(self, node_id: str, epoch: int,
                           inventory: list[tuple[PageKey, int]], seq: int) -> bool:
        await self.ready()
        replaced = self.index.replace_node(node_id, epoch, inventory, seq, time.monotonic())
        if replaced and self.mirror is not None:
            self.mirror.record_drop(node_id)
            self.mirror.record_node(node_id, epoch, seq)
            self.mirror.record(node_id, inventory)
        return replaced

    async def drop_node(self, node_id: str) -> int:
        await self.ready()
        return self.drop(node_id, "reported dead") if node_id in self.index.nodes else 0

    # ---- queries -------------------------------------------------------------------------

    async def match(self, keys_blob: bytes) -> list[list]:
        """Longest-prefix match of the concatenated 16-byte keys, as runs (see match_runs)."""
        await self.ready()
        keys = [keys_blob[i : i + KEY_BYTES] for i in range(0, len(keys_blob), KEY_BYTES)]
        return self.index.match_runs(keys)

    async def get_config(self) -> str:
        return self.config_json

    async def stats(self) -> dict:
        await self.ready()
        redis = None
        if self.mirror is not None:
            redis = {"healthy": self.mirror.healthy, "flushes": self.mirror.num_flushes}
        return {"shard": self.shard, "recovered": self.recovered, "redis": redis,
                "purged_nodes": len(self.purged_nodes), **self.index.stats()}

    async def flush_redis(self) -> bool:
        """Write pending state to Redis now (tests and shutdown); False if Redis is down."""
        await self.ready()
        return self.mirror is not None and await self.mirror.flush(self.index)

    async def ping(self) -> int:
        return self.shard
