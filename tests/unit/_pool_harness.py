"""A Pool test harness: pools over a temp disk dir, page helpers, consistency checks."""

from __future__ import annotations

import asyncio
import os

import torch

from cluster.core.geometry import DEVICE, DISK, HOST
from cluster.core.pool import Pool, PoolLimits
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
    unique_prefix,
)


class Harness:
    """Builds pools over one temp disk dir and closes them all at teardown."""

    def __init__(self) -> None:
        self.disk_dir = make_disk_dir()
        self.prefix = unique_prefix()
        self.pools: list[Pool] = []
        self.events: list[tuple[bytes, int | None]] = []

    def make(self, device_pages=2, host_pages=2, disk_pages=3, eviction="lru",
             codec="none") -> Pool:
        limits = PoolLimits(device_pages * PAGE_BYTES, host_pages * PAGE_BYTES,
                            disk_pages * DISK_SLOT_BYTES, eviction, codec, False, self.prefix)
        disk = None
        if disk_pages:
            path = os.path.join(self.disk_dir, f"pool{len(self.pools)}")
            disk = DiskArena(path, limits.disk_bytes, PAGE_BYTES, 2)
        pool = Pool(GEOMETRY, limits, disk, lambda k, t: self.events.append((k, t)))
        self.pools.append(pool)
        return pool

    def close(self) -> None:
        for pool in self.pools:
            pool.close()
        remove_dir(self.disk_dir)


def run(coro):
    return asyncio.run(coro)


async def put(pool: Pool, ids: list[int]) -> int:
    """Store pages like a same-node client: reserve, write into the slot, commit."""
    keys = [key(i) for i in ids]
    slots = await pool.reserve(keys)
    assert slots, "no room"
    for i, slot in zip(ids, slots, strict=True):
        if slot is not None:
            pool.memory[slot[0]].view(slot[1])[:PAGE_BYTES].copy_(page_bytes(i))
    return pool.commit(keys)


async def put_each(pool: Pool, ids) -> None:
    for i in ids:
        assert await put(pool, [i]) == 1


async def read(pool: Pool, ids: list[int]) -> list[torch.Tensor]:
    """Acquire, copy the pages out, release (what a get does)."""
    keys = [key(i) for i in ids]
    located = await pool.acquire(keys)
    try:
        return [as_page(pool.memory[tier].view(slot)) for tier, slot in located]
    finally:
        pool.release(keys[: len(located)])


def tiers(pool: Pool) -> dict[str, list[int]]:
    """Page ids per tier, sorted."""
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
    calls: list[list[int]] = []
    original = pool.disk.read_pages

    def counting(slots, outs):
        calls.append(list(slots))
        return original(slots, outs)

    pool.disk.read_pages = counting
    return calls
