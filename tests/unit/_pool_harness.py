"""The pool and store test harness: pools and NodeStores over a temp disk dir, an event
recorder, page helpers (puts that write into reserved slots, reads, page ids per tier, disk
read counting) and consistency checks. Shared by test_pool*, test_store_* and conftest."""

from __future__ import annotations

import asyncio
import itertools
import os

import numpy as np
import torch

from cluster.core.geometry import DEVICE, DISK, HOST, PageGeometry
from cluster.core.pool import Pool, PoolLimits
from cluster.core.store import NodeStore, StoreConfig
from cluster.core.tiers.disk import DiskArena
from tests.unit._pages import (
    DISK_SLOT_BYTES,
    GEOMETRY,
    PAGE_BYTES,
    as_page,
    key,
    make_disk_dir,
    page_bytes,
    remove_dir,
    shm_files,
    unique_prefix,
)

_owners = itertools.count(1000)


def new_owner() -> int:
    """A fresh reservation id for Pool.reserve/commit/abort."""
    return next(_owners)


def run(coro):
    return asyncio.run(coro)


def as_raw(i: int) -> np.ndarray:
    """Page i's bytes, as a store's readers copy them out."""
    return page_bytes(i).numpy().copy()


def read_pages(store: NodeStore, keys: list[bytes]) -> list[np.ndarray]:
    """Copies of the longest local prefix's pages."""
    return run(store.map_pages(GEOMETRY, keys, np.copy))


class EventRecorder:
    """An on_event sink: every change in order (`log`), and the latest state per key since
    the previous drain() (key -> tier, or None when the page is gone)."""

    def __init__(self) -> None:
        self.log: list[tuple[bytes, int | None]] = []
        self._latest: dict[bytes, int | None] = {}

    def add(self, key: bytes, tier: int | None) -> None:
        self.log.append((key, tier))
        self._latest[key] = tier

    def drain(self) -> dict[bytes, int | None]:
        latest, self._latest = self._latest, {}
        return latest


def make_limits(prefix: str, device_pages=2, host_pages=2, disk_pages=3, eviction="lru",
                codec="none") -> PoolLimits:
    """Tiers of a few test pages each (CPU stand-in for the device tier)."""
    return PoolLimits(device_pages * PAGE_BYTES, host_pages * PAGE_BYTES,
                      disk_pages * DISK_SLOT_BYTES, eviction, codec, False, prefix)


class Harness:
    """Builds pools over one temp disk dir and closes them all at teardown."""

    def __init__(self) -> None:
        self.disk_dir = make_disk_dir()
        self.prefix = unique_prefix()
        self.pools: list[Pool] = []
        self.recorder = EventRecorder()

    @property
    def events(self) -> list[tuple[bytes, int | None]]:
        """Every event of every pool, in order."""
        return self.recorder.log

    def make(self, device_pages=2, host_pages=2, disk_pages=3, eviction="lru",
             codec="none") -> Pool:
        limits = make_limits(self.prefix, device_pages, host_pages, disk_pages, eviction, codec)
        disk = None
        if disk_pages:
            path = os.path.join(self.disk_dir, f"pool{len(self.pools)}")
            disk = DiskArena(path, limits.disk_bytes, PAGE_BYTES, 2)
        pool = Pool(GEOMETRY, limits, disk, self.recorder.add)
        self.pools.append(pool)
        return pool

    def close(self) -> None:
        for pool in self.pools:
            pool.close()
        remove_dir(self.disk_dir)

    def leftover_shm(self) -> list[str]:
        return shm_files(self.prefix)


class Stores:
    """Builds NodeStores over one temp disk dir, each with its own EventRecorder; closes
    them all at teardown."""

    def __init__(self) -> None:
        self.disk_dir = make_disk_dir()
        self.prefixes: list[str] = []
        self.stores: list[NodeStore] = []
        self._recorders: dict[int, EventRecorder] = {}

    def config(self, device_pages=2, host_pages=2, disk_pages=3, codec="none",
               eviction="lru", pin_lease_s=30.0, reserve_lease_s=30.0,
               max_geometries=4) -> StoreConfig:
        prefix = unique_prefix()
        self.prefixes.append(prefix)
        limits = make_limits(prefix, device_pages, host_pages, disk_pages, eviction, codec)
        return StoreConfig(limits, self.disk_dir, pin_lease_s=pin_lease_s, disk_threads=2,
                           max_geometries=max_geometries, reserve_lease_s=reserve_lease_s)

    def make(self, config: StoreConfig | None = None, **kwargs) -> NodeStore:
        recorder = EventRecorder()
        store = NodeStore(config or self.config(**kwargs), recorder.add)
        self.stores.append(store)
        self._recorders[id(store)] = recorder
        return store

    def events(self, store: NodeStore) -> EventRecorder:
        """The recorder of a store made here (its on_event)."""
        return self._recorders[id(store)]

    def close(self) -> None:
        for store in self.stores:
            store.close()
        remove_dir(self.disk_dir)

    def leftover_shm(self) -> list[str]:
        return [name for prefix in self.prefixes for name in shm_files(prefix)]


# ---- puts and reads ----------------------------------------------------------------------


def write_pages(pool: Pool, ids: list[int], slots: list[tuple[int, int] | None]) -> None:
    """Write page i's bytes into the slot reserved for it (None: already stored), as a
    same-node client does through its mapping."""
    for i, slot in zip(ids, slots, strict=True):
        if slot is not None:
            pool.memory[slot[0]].view(slot[1])[:PAGE_BYTES].copy_(page_bytes(i))


async def put(pool: Pool, ids: list[int]) -> int:
    """Store pages like a same-node client: reserve, write into the slot, commit."""
    keys = [key(i) for i in ids]
    owner = new_owner()
    slots = await pool.reserve(keys, owner)
    assert slots, "no room"
    write_pages(pool, ids, slots)
    return pool.commit(keys, owner)


async def put_each(pool: Pool, ids) -> None:
    for i in ids:
        assert await put(pool, [i]) == 1


async def store_put(store: NodeStore, ids: list[int], geometry: PageGeometry = GEOMETRY) -> int:
    """A same-node client's put through a NodeStore: reserve, write into the slot, commit."""
    reservation_id, slots = await store.reserve(geometry, [key(i) for i in ids])
    assert slots, "no room"
    write_pages(store.pool(geometry), ids, slots)
    return store.commit(reservation_id)


async def store_put_each(store: NodeStore, ids) -> None:
    for i in ids:
        assert await store_put(store, [i]) == 1


async def read(pool: Pool, ids: list[int]) -> list[torch.Tensor]:
    """Acquire, copy the pages out, release (what a get does)."""
    keys = [key(i) for i in ids]
    located = await pool.acquire(keys)
    try:
        return [as_page(pool.memory[tier].view(slot)) for tier, slot, _ in located]
    finally:
        pool.release(keys[: len(located)])


# ---- inspection --------------------------------------------------------------------------


def tiers(pool: Pool) -> dict[str, list[int]]:
    """Page ids per tier, sorted (pending pages included)."""
    out: dict[str, list[int]] = {"device": [], "host": [], "disk": []}
    names = {DEVICE: "device", HOST: "host", DISK: "disk"}
    for k, entry in pool.index.items():
        out[names[entry.tier]].append(int.from_bytes(k[1:], "little"))
    return {name: sorted(ids) for name, ids in out.items()}


def assert_slots_consistent(pool: Pool) -> None:
    """Every entry owns a distinct used slot, and no used slot is unowned."""
    for tier in (DEVICE, HOST):
        owned = sorted(e.slot for e in pool.index.values() if e.tier == tier)
        assert len(set(owned)) == len(owned)
        assert pool.memory[tier].slots.num_used == len(owned)
    on_disk = sorted(e.slot for e in pool.index.values() if e.tier == DISK)
    assert len(set(on_disk)) == len(on_disk)
    if pool.disk is not None:
        assert pool.disk.num_used == len(on_disk)


def count_reads(pool: Pool) -> list[list[int]]:
    """Record the slots of every disk read of the pool from now on (one list per call)."""
    calls: list[list[int]] = []
    original = pool.disk.read_pages

    def counting(slots, outs):
        calls.append(list(slots))
        return original(slots, outs)

    pool.disk.read_pages = counting
    return calls
