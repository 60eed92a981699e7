"""NodeCacheActor: a thin async Ray shell around one node's NodeStore.

It owns the node's tiers, serves same-node clients through shared memory (reserve/commit,
acquire/release) and other nodes through Ray objects (export_pages/adopt, put_pages), and ships its
`stored`/`removed` events to the directory shards in batches with an epoch and sequence numbers.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from actors.exports import ExportCache
from actors.handles import DirectoryHandle, NodeHandle
from cluster.core.config import CacheConfig
from cluster.core.directory_index import FENCED, RESYNC
from cluster.core.geometry import HOST, PageGeometry
from cluster.core.keys import PageKey, shard_of
from cluster.core.pool import PoolLimits
from cluster.core.store import NodeStore, StoreConfig
from cluster.core.tiers.memory import cuda_available
from cluster.core.tiers.node_slot import NodeSlot, claim_node_slot

log = logging.getLogger("raykv.node")


def store_config(config: CacheConfig, slot: NodeSlot) -> StoreConfig:
    limits = PoolLimits(config.device_bytes, config.host_bytes, config.disk_bytes,
                        config.eviction, config.disk_codec, cuda_available(), slot.shm_prefix)
    return StoreConfig(limits, slot.disk_dir, config.pin_lease_s, config.disk_threads)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class NodeCacheActor:
    """One per node: the node's tiers, index and event stream."""

    def __init__(self, config_json: str, node_id: str):
        self.config = CacheConfig.model_validate_json(config_json)
        self.node_id = node_id
        self.epoch = time.time_ns()  # grows across restarts: the directory fences older ones
        self.slot = claim_node_slot(self.config.disk_dir)  # held until this process ends
        self.store = NodeStore(store_config(self.config, self.slot))
        self.exports = ExportCache(self.store, self.config.export_cache_bytes)
        self.directory = DirectoryHandle.lookup(self.config)
        self._seq = [0] * self.config.num_directory_shards
        self._flush_lock = asyncio.Lock()
        self._started: asyncio.Task | None = None
        self._loop_task: asyncio.Task | None = None
        self.recovered_pages = 0
        self._pulls: dict[PageKey, asyncio.Future] = {}
        self._peers: dict[str, NodeHandle | None] = {}
        self.counters = {"pulled_pages": 0}

    async def ready(self) -> dict:
        """Recover disk pages, register with the directory, start the event loop.

        Every public method awaits this first, so an actor that Ray restarted on its own
        (max_restarts) recovers before it serves anything.
        """
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)
        return {"node_id": self.node_id, "epoch": self.epoch,
                "recovered_pages": self.recovered_pages}

    async def _start(self) -> None:
        self.recovered_pages = await asyncio.to_thread(self.store.recover_disk)
        await self.sync_inventory()
        self._loop_task = asyncio.create_task(self._flush_loop())

    async def _flush_loop(self) -> None:
        last_beat_s = 0.0
        while True:
            await asyncio.sleep(self.config.event_flush_s)
            try:
                beat = time.monotonic() - last_beat_s >= self.config.heartbeat_s
                if await self.flush(heartbeat=beat):
                    last_beat_s = time.monotonic()
            except Exception:  # a dead directory is a status: keep serving, retry next tick
                log.exception("event flush failed")

    async def flush(self, heartbeat: bool = False) -> bool:
        """Ship pending events (and a heartbeat) to every shard; True when sent.

        A shard that answers RESYNC (it purged us, or restarted empty) gets our whole
        inventory right after.
        """
        async with self._flush_lock:
            changes = self.store.events.drain()
            if not changes and not heartbeat:
                return False
            per_shard = self._split(list(changes.items()))
            shards, calls = [], []
            for shard, batch in enumerate(per_shard):
                if batch or heartbeat:
                    self._seq[shard] += 1
                    shards.append(shard)
                    calls.append(self.directory.apply(shard, self.node_id, self.epoch,
                                                      self._seq[shard], batch))
            statuses = await asyncio.gather(*calls)
        if RESYNC in statuses:
            await self.sync_inventory()
        elif FENCED in statuses:
            log.error("node %s epoch %d is fenced off by the directory", self.node_id[:8],
                      self.epoch)
        return True

    def _split(self, items: list[tuple[PageKey, int | None]]) -> list[list]:
        per_shard: list[list] = [[] for _ in self._seq]
        for key, tier in items:
            per_shard[shard_of(key, len(self._seq))].append((key, tier))
        return per_shard

    async def sync_inventory(self) -> None:
        """Send the full inventory to every shard (start-up, or a directory that restarted)."""
        async with self._flush_lock:
            self.store.events.drain()
            per_shard = self._split(self.store.inventory())
            calls = []
            for shard, batch in enumerate(per_shard):
                self._seq[shard] += 1
                calls.append(self.directory.replace_node(shard, self.node_id, self.epoch,
                                                         batch, self._seq[shard]))
            await asyncio.gather(*calls)

    # ---- same-node clients (shared memory) -----------------------------------------------

    # Replies carry the epoch: a client whose mapping is from an earlier incarnation of this
    # actor (whose slabs are gone) must map the new slabs before touching any slot.

    async def descriptors(self, geometry: PageGeometry):
        await self.ready()
        return self.epoch, self.store.descriptors(geometry)

    async def reserve(self, geometry: PageGeometry, keys: list[PageKey]):
        await self.ready()
        return self.epoch, await self.store.reserve(geometry, keys)

    async def commit(self, geometry: PageGeometry, keys: list[PageKey]) -> int:
        await self.ready()
        committed = self.store.commit(geometry, keys)
        await self.flush()  # read-your-writes: the directory knows before put() returns
        return committed

    async def abort(self, geometry: PageGeometry, keys: list[PageKey]) -> None:
        await self.ready()
        self.store.pool(geometry).abort(keys)

    async def acquire(self, geometry: PageGeometry, keys: list[PageKey]):
        """Pin the longest local prefix of `keys`: (epoch, lease_id, [(tier, slot), ...])."""
        await self.ready()
        return self.epoch, *await self.store.acquire(geometry, keys)

    async def release(self, lease_id: int) -> None:
        await self.ready()
        self.store.release(lease_id)

    # ---- remote clients (Ray objects) ----------------------------------------------------

    async def put_pages(self, geometry: PageGeometry, keys: list[PageKey], pages: list) -> int:
        await self.ready()
        stored = await self.store.put_pages(geometry, keys, pages)
        await self.flush()
        return stored

    async def prefetch(self, geometry: PageGeometry, keys: list[PageKey],
                       remote: dict[str, list[PageKey]] | None = None) -> int:
        """Pull `remote` pages into the host tier and promote local ones; returns pages ready."""
        await self.ready()
        if remote:
            await self.pull(geometry, remote)
        return await self.store.prefetch(geometry, keys)

    async def pull(self, geometry: PageGeometry, remote: dict[str, list[PageKey]]) -> int:
        """Copy pages from other nodes into this node's host tier; returns pages pulled.

        A page already being pulled for another request is awaited, not fetched twice.
        """
        await self.ready()
        waits, calls = set(), []
        for node_id, keys in remote.items():
            waits.update(self._pulls[k] for k in keys if k in self._pulls)
            todo = [k for k in keys if k not in self._pulls and not self.store.has(geometry, k)]
            if todo:
                # Claimed before the first await, so a request arriving meanwhile waits on it.
                done = asyncio.get_running_loop().create_future()
                self._pulls.update(dict.fromkeys(todo, done))
                calls.append(self._pull_from(geometry, node_id, todo, done))
        pulled = await asyncio.gather(*calls)
        await asyncio.gather(*(asyncio.shield(w) for w in waits))
        return sum(pulled)

    async def _pull_from(self, geometry: PageGeometry, node_id: str, keys: list[PageKey],
                         done: asyncio.Future) -> int:
        try:
            peer = await self._peer(node_id)
            refs = await peer.export_pages(geometry, keys) if peer is not None else []
            return await self.adopt(geometry, keys[: len(refs)], refs)
        except ray.exceptions.RayError as error:  # a dead peer: its pages are misses
            log.warning("pull from %s failed: %s", node_id[:8], error)
            return 0
        finally:
            for key in keys:
                self._pulls.pop(key, None)
            done.set_result(None)

    async def adopt(self, geometry: PageGeometry, keys: list[PageKey], refs: list) -> int:
        """Keep pages another node exported (Ray objects) in this node's host tier."""
        await self.ready()
        pages = await asyncio.gather(*refs)
        stored = await self.store.put_pages(geometry, keys, list(pages), HOST)
        self.counters["pulled_pages"] += stored
        await self.flush()
        return stored

    async def export_pages(self, geometry: PageGeometry, keys: list[PageKey]) -> list:
        """The longest local prefix of `keys` as Ray objects (one per page), for other nodes."""
        await self.ready()
        return await self.exports.export(geometry, keys)

    async def _peer(self, node_id: str) -> NodeHandle | None:
        if node_id not in self._peers:
            # get_actor is a blocking GCS call: keep it off the event loop.
            self._peers[node_id] = await asyncio.to_thread(NodeHandle.lookup, node_id,
                                                            self.config)
        return self._peers[node_id]

    # ---- introspection -------------------------------------------------------------------

    async def inventory(self) -> list[tuple[PageKey, int]]:
        await self.ready()
        return self.store.inventory()

    async def stats(self) -> dict:
        await self.ready()
        return {"node_id": self.node_id, "epoch": self.epoch, "disk_dir": self.slot.disk_dir,
                **self.store.stats(), **self.counters, **self.exports.counters}

    async def shutdown(self) -> None:
        """Release the shared-memory slabs (disk slabs stay, for the next start)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
        self.store.close()

    async def ping(self) -> str:
        await self.ready()
        return self.node_id
