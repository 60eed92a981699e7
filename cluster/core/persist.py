"""Write-behind persistence of one directory shard to Redis (redis-py asyncio, hiredis parser).

    {prefix}:nodes          hash  node_id -> "epoch:watermark"
    {prefix}:n:{node_id}    hash  page key (16 bytes) -> tier

Changes are buffered and written in pipelines. While Redis is unreachable the shard keeps
serving from memory, warns once, and drops the buffer; when Redis answers again the whole
shard is rewritten, so Redis catches up without replaying anything.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from cluster.core.directory_index import DirectoryIndex
from cluster.core.keys import PageKey

log = logging.getLogger("raykv.persist")


@dataclass(slots=True)
class Pending:
    changes: dict[str, dict[PageKey, int | None]] = field(default_factory=dict)
    nodes: dict[str, tuple[int, int] | None] = field(default_factory=dict)
    resets: set[str] = field(default_factory=set)  # node hashes to clear before writing

    def __bool__(self) -> bool:
        return bool(self.changes or self.nodes or self.resets)


def directory_key_prefix(ray_namespace: str, key_space: str, shard: int) -> str:
    """The Redis key prefix of one directory shard: raykv:<ray namespace>[:<key space>]:dir<N>
    (no key space: the keys raykv always used)."""
    space = f":{key_space}" if key_space else ""
    return f"raykv:{ray_namespace}{space}:dir{shard}"


class RedisMirror:
    """Mirrors a DirectoryIndex into Redis, write-behind."""

    def __init__(self, url: str, prefix: str):
        self.redis = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=1.0)
        self.prefix = prefix
        self.pending = Pending()
        self.healthy = True
        self.needs_rewrite = False
        self.num_flushes = 0

    def _node_key(self, node_id: str) -> str:
        return f"{self.prefix}:n:{node_id}"

    # ---- recording (sync, on the actor loop) ---------------------------------------------

    def record(self, node_id: str, changes: list[tuple[PageKey, int | None]]) -> None:
        bucket = self.pending.changes.setdefault(node_id, {})
        for key, tier in changes:
            bucket[key] = tier

    def record_node(self, node_id: str, epoch: int, watermark: int) -> None:
        self.pending.nodes[node_id] = (epoch, watermark)

    def record_drop(self, node_id: str) -> None:
        self.pending.changes.pop(node_id, None)
        self.pending.nodes[node_id] = None
        self.pending.resets.add(node_id)

    # ---- flushing ------------------------------------------------------------------------

    async def flush(self, index: DirectoryIndex) -> bool:
        """Write what is pending (or everything, after an outage); False if Redis is down."""
        pending, self.pending = self.pending, Pending()
        try:
            if self.needs_rewrite:
                await self._rewrite(index)
            elif pending:
                await self._write(pending)
        except (RedisError, OSError) as error:
            self._went_down(error)
            return False
        if not self.healthy:
            log.warning("Redis is back: directory state rewritten to %s", self.prefix)
        self.healthy, self.needs_rewrite = True, False
        self.num_flushes += 1
        return True

    def _went_down(self, error: Exception) -> None:
        if self.healthy:
            log.warning("Redis unreachable (%s); serving from memory, will catch up", error)
        self.healthy = False
        self.needs_rewrite = True
        self.pending = Pending()

    async def _write(self, pending: Pending) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for node_id in pending.resets:
            pipe.delete(self._node_key(node_id))
        for node_id, state in pending.nodes.items():
            if state is None:
                pipe.hdel(f"{self.prefix}:nodes", node_id)
            else:
                pipe.hset(f"{self.prefix}:nodes", node_id, f"{state[0]}:{state[1]}")
        for node_id, changes in pending.changes.items():
            stored = {key: tier for key, tier in changes.items() if tier is not None}
            removed = [key for key, tier in changes.items() if tier is None]
            if stored:
                pipe.hset(self._node_key(node_id), mapping=stored)
            if removed:
                pipe.hdel(self._node_key(node_id), *removed)
        await pipe.execute()

    async def _rewrite(self, index: DirectoryIndex) -> None:
        old = [name async for name in self.redis.scan_iter(match=f"{self.prefix}:*")]
        pipe = self.redis.pipeline(transaction=False)
        if old:
            pipe.delete(*old)
        for node_id, node_log in index.nodes.items():
            pipe.hset(f"{self.prefix}:nodes", node_id, f"{node_log.epoch}:{node_log.watermark}")
            inventory = dict(index.node_inventory(node_id))
            if inventory:
                pipe.hset(self._node_key(node_id), mapping=inventory)
        await pipe.execute()

    # ---- recovery ------------------------------------------------------------------------

    async def load(self, index: DirectoryIndex) -> int:
        """Rebuild `index` from Redis; returns the number of page locations loaded."""
        nodes = await self.redis.hgetall(f"{self.prefix}:nodes")
        loaded = 0
        for raw_node, raw_state in nodes.items():
            node_id = raw_node.decode()
            epoch, watermark = (int(part) for part in raw_state.decode().split(":"))
            entries = await self.redis.hgetall(self._node_key(node_id))
            inventory = [(PageKey(key), int(tier)) for key, tier in entries.items()]
            index.replace_node(node_id, epoch, inventory, watermark)
            loaded += len(inventory)
        return loaded

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self.redis.aclose()
