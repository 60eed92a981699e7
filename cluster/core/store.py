"""NodeStore: everything one node holds, as a pure object owned by the node actor.

It keeps one Pool per page geometry, the read leases (pins with a deadline, so a client that
dies mid-read cannot pin pages forever) and the buffer of `stored`/`removed` events that the
actor ships to the directory in batches.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from cluster.core.geometry import TIER_NAMES, PageGeometry
from cluster.core.keys import PageKey
from cluster.core.pool import Pool, PoolLimits, State
from cluster.core.tiers.disk import DiskArena
from cluster.core.tiers.memory import ArenaDescriptor, remove_stale_shm

POOL_FILE = "pool.json"
log = logging.getLogger("raykv.store")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Per-node settings of a NodeStore."""

    limits: PoolLimits
    disk_dir: str
    pin_lease_s: float = 30.0
    disk_threads: int = 4


@dataclass(slots=True)
class Lease:
    geometry: PageGeometry
    keys: list[PageKey]
    deadline_s: float


@dataclass(slots=True)
class EventBuffer:
    """Events since the last flush: key -> tier index, or None when removed."""

    changes: dict[PageKey, int | None] = field(default_factory=dict)

    def add(self, key: PageKey, tier: int | None) -> None:
        self.changes[key] = tier  # only the latest state of a key matters

    def drain(self) -> dict[PageKey, int | None]:
        changes, self.changes = self.changes, {}
        return changes


class NodeStore:
    """All pools of one node, plus leases and pending directory events."""

    def __init__(self, config: StoreConfig):
        self.config = config
        remove_stale_shm(config.limits.shm_prefix)
        self.pools: dict[PageGeometry, Pool] = {}
        self.leases: dict[int, Lease] = {}
        self.events = EventBuffer()
        self._lease_ids = itertools.count(1)
        self.counters = {"puts": 0, "gets": 0, "hits_pages": 0, "misses_pages": 0}

    # ---- pools ---------------------------------------------------------------------------

    def pool(self, geometry: PageGeometry) -> Pool:
        """The pool for a geometry, created on first use."""
        if geometry not in self.pools:
            self.pools[geometry] = self._make_pool(geometry)
        return self.pools[geometry]

    def _make_pool(self, geometry: PageGeometry) -> Pool:
        limits = self.config.limits
        disk = None
        if limits.disk_bytes >= geometry.slot_bytes + 4096:
            disk = self._open_disk(os.path.join(self.config.disk_dir, geometry.name), geometry)
        return Pool(geometry, limits, disk, self.events.add)

    def _open_disk(self, path: str, geometry: PageGeometry) -> DiskArena:
        """The pool's slabs; slabs laid out for another capacity are discarded, loudly."""
        os.makedirs(path, exist_ok=True)
        args = (path, self.config.limits.disk_bytes, geometry.page_bytes, self.config.disk_threads)
        try:
            disk = DiskArena(*args)
        except ValueError as mismatch:
            log.warning("discarding cached pages in %s, laid out for another capacity: %s",
                        path, mismatch)
            shutil.rmtree(path)
            os.makedirs(path)
            disk = DiskArena(*args)
        _write_pool_file(path, geometry)
        return disk

    def recover_disk(self) -> int:
        """Re-open every pool found on disk and index its verified pages."""
        if not os.path.isdir(self.config.disk_dir):
            return 0
        found = 0
        for name in sorted(os.listdir(self.config.disk_dir)):
            geometry = _read_pool_file(os.path.join(self.config.disk_dir, name))
            if geometry is None:
                continue
            pool = self.pool(geometry)
            if pool.disk is not None:
                found += pool.adopt_disk_pages(pool.disk.scan())
        return found

    def descriptors(self, geometry: PageGeometry) -> list[ArenaDescriptor]:
        return [arena.descriptor() for arena in self.pool(geometry).memory]

    # ---- puts ----------------------------------------------------------------------------

    async def reserve(self, geometry: PageGeometry, keys: list[PageKey],
                      tier: int | None = None):
        self._expire_leases()  # a dead reader's pins must not keep puts out
        return await self.pool(geometry).reserve(keys, tier)

    def has(self, geometry: PageGeometry, key: PageKey) -> bool:
        """Whether a ready copy of the page is here (any tier)."""
        pool = self.pools.get(geometry)
        return pool is not None and pool.local_prefix([key]) == 1

    def commit(self, geometry: PageGeometry, keys: list[PageKey]) -> int:
        self.counters["puts"] += 1
        return self.pool(geometry).commit(keys)

    async def put_pages(self, geometry: PageGeometry, keys: list[PageKey],
                        pages: list[np.ndarray], tier: int | None = None) -> int:
        """Store pages whose bytes arrived through Ray (remote or non-mapping clients).

        Only the keys this call reserved are written and committed (a key that another put
        holds reserved is that put's to commit); a bad page aborts them all.
        """
        if len(pages) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(pages)} pages")
        reserved = await self.reserve(geometry, keys, tier)
        if not reserved:
            return 0
        pool = self.pool(geometry)
        keys = keys[: len(reserved)]
        mine = [key for key, slot in zip(keys, reserved, strict=True) if slot is not None]
        try:
            for key, slot, page in zip(keys, reserved, pages[: len(reserved)], strict=True):
                if slot is not None:
                    pool.write_page(key, page)
        except BaseException:
            pool.abort(mine)
            raise
        self.commit(geometry, mine)
        return len(reserved)  # the prefix now stored, ours or already there

    # ---- gets ----------------------------------------------------------------------------

    async def acquire(self, geometry: PageGeometry, keys: list[PageKey]):
        """Pin the longest local prefix; returns (lease_id, [(tier, slot), ...])."""
        self._expire_leases()
        located = await self.pool(geometry).acquire(keys)
        self.counters["gets"] += 1
        self.counters["hits_pages"] += len(located)
        self.counters["misses_pages"] += len(keys) - len(located)
        if not located:
            return 0, []
        lease_id = next(self._lease_ids)
        deadline_s = time.monotonic() + self.config.pin_lease_s
        self.leases[lease_id] = Lease(geometry, keys[: len(located)], deadline_s)
        return lease_id, located

    def release(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            self.pool(lease.geometry).release(lease.keys)

    def _expire_leases(self) -> None:
        now_s = time.monotonic()
        for lease_id in [i for i, lease in self.leases.items() if lease.deadline_s < now_s]:
            self.release(lease_id)

    async def map_pages(self, geometry: PageGeometry, keys: list[PageKey],
                        fn: Callable[[np.ndarray], T]) -> list[T]:
        """fn(bytes of the page) for each page of the longest local prefix, while it is pinned.

        `fn` gets a view into the slab: it must copy what it keeps (np.copy, ray.put).
        """
        lease_id, located = await self.acquire(geometry, keys)
        pool = self.pool(geometry)
        try:
            return [fn(pool.memory[tier].view(slot)[: geometry.page_bytes].cpu().numpy())
                    for tier, slot in located]
        finally:
            self.release(lease_id)

    async def read_pages(self, geometry: PageGeometry, keys: list[PageKey]) -> list[np.ndarray]:
        """Copies of the longest local prefix's pages."""
        return await self.map_pages(geometry, keys, np.copy)

    async def prefetch(self, geometry: PageGeometry, keys: list[PageKey]) -> int:
        """Promote the local prefix toward the top tier; returns pages now in memory."""
        pool = self.pool(geometry)
        count = pool.local_prefix(keys)
        await pool.load_from_disk(keys[:count])
        await pool.promote_many(keys[:count])
        return sum(1 for k in keys[:count] if k in pool.index and pool.index[k].tier < 2)

    # ---- inventory and stats -------------------------------------------------------------

    def inventory(self) -> list[tuple[PageKey, int]]:
        """Every ready page as (key, tier): lets a restarted directory rebuild its index."""
        return [(key, entry.tier) for pool in self.pools.values()
                for key, entry in pool.index.items() if entry.state != State.PENDING]

    def stats(self) -> dict:
        pages = {name: 0 for name in TIER_NAMES}
        used_bytes = {name: 0 for name in TIER_NAMES}
        for pool in self.pools.values():
            for name, count in pool.tier_counts().items():
                pages[name] += count
                used_bytes[name] += count * pool.geometry.page_bytes
        return {"pages": pages, "bytes": used_bytes, "leases": len(self.leases),
                **self.counters}

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


def _write_pool_file(path: str, geometry: PageGeometry) -> None:
    with open(os.path.join(path, POOL_FILE), "w") as handle:
        json.dump({"shape": list(geometry.shape), "dtype": geometry.dtype}, handle)


def _read_pool_file(path: str) -> PageGeometry | None:
    try:
        with open(os.path.join(path, POOL_FILE)) as handle:
            data = json.load(handle)
        return PageGeometry(tuple(data["shape"]), data["dtype"])
    except (OSError, ValueError, KeyError):
        return None
