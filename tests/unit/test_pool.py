"""Pool: one page geometry, tiers device -> host -> disk -> dropped, reserve/commit/abort, pins,
promotion (load_from_disk + promote_many), shared in-flight disk loads and quantized
demotion. Pure asyncio, no Ray.

Geometry: 8192-byte float32 pages; tiers of a few pages each (see make()).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from cluster.core.geometry import DEVICE, DISK, HOST
from cluster.core.pool import State
from cluster.core.tiers.disk import DiskArena
from tests.unit._pages import (
    DISK_SLOT_BYTES,
    PAGE_BYTES,
    as_page,
    flip_disk_byte,
    key,
    page,
    page_bytes,
    shm_files,
)
from tests.unit._pool_harness import (
    assert_slots_consistent,
    count_reads,
    put,
    put_each,
    read,
    run,
    tiers,
)

# ---- puts land in the top tier, eviction cascades down ---------------------------------


def test_put_lands_in_the_top_tier(harness):
    pool = harness.make()
    assert run(put(pool, [0])) == 1
    assert pool.tier_counts() == {"device": 1, "host": 0, "disk": 0}
    assert pool.index[key(0)].state == State.READY
    assert harness.events == [(key(0), DEVICE)]
    assert pool.local_prefix([key(0), key(1)]) == 1


def test_lru_cascade_device_host_disk_dropped(harness):
    pool = harness.make(eviction="lru")
    run(put_each(pool, range(8)))
    assert pool.tier_counts() == {"device": 2, "host": 2, "disk": 3}
    assert tiers(pool) == {"device": [6, 7], "host": [4, 5], "disk": [1, 2, 3]}
    assert key(0) not in pool.index
    assert harness.events.count((key(0), None)) == 1
    assert [k for k, t in harness.events if t is None] == [key(0)]
    assert (key(0), DISK) in harness.events and (key(4), HOST) in harness.events
    assert_slots_consistent(pool)


def test_s3fifo_cascade_keeps_tier_capacities(harness):
    pool = harness.make(eviction="s3fifo")
    run(put_each(pool, range(8)))
    assert pool.tier_counts() == {"device": 2, "host": 2, "disk": 3}
    assert tiers(pool) == {"device": [6, 7], "host": [4, 5], "disk": [1, 2, 3]}
    assert [k for k, t in harness.events if t is None] == [key(0)]
    assert_slots_consistent(pool)


def test_lru_access_protects_a_page_from_eviction(harness):
    pool = harness.make(eviction="lru")

    async def scenario():
        await put_each(pool, [0, 1])
        assert len(await read(pool, [0])) == 1  # 0 is now the most recently used
        await put_each(pool, [2])

    run(scenario())
    assert tiers(pool) == {"device": [0, 2], "host": [1], "disk": []}


def test_without_a_disk_host_victims_are_dropped(harness):
    pool = harness.make(disk_pages=0)
    run(put_each(pool, range(6)))
    assert tiers(pool) == {"device": [4, 5], "host": [2, 3], "disk": []}
    assert [k for k, t in harness.events if t is None] == [key(0), key(1)]
    assert_slots_consistent(pool)


def test_without_a_device_tier_puts_land_in_host(harness):
    pool = harness.make(device_pages=0, disk_pages=2)
    run(put_each(pool, range(5)))
    assert pool.top_tier == HOST
    assert tiers(pool) == {"device": [], "host": [3, 4], "disk": [1, 2]}
    assert run(read(pool, [1]))[0].equal(page(1))
    assert pool.index[key(1)].tier == HOST


# ---- data survives demotion and promotion ----------------------------------------------


def test_data_is_byte_exact_after_disk_and_back(harness):
    pool = harness.make(disk_pages=8)
    run(put_each(pool, range(7)))
    assert tiers(pool) == {"device": [5, 6], "host": [3, 4], "disk": [0, 1, 2]}
    for i in range(7):
        got = run(read(pool, [i]))
        assert len(got) == 1
        assert got[0].view(torch.uint8).equal(page(i).view(torch.uint8)), f"page {i}"
    assert sum(pool.tier_counts().values()) == 7  # nothing dropped
    assert [k for k, t in harness.events if t is None] == []
    assert_slots_consistent(pool)


def test_a_disk_read_into_a_full_host_overlaps_the_demotions_and_stays_exact(harness):
    pool = harness.make(disk_pages=8)
    run(put_each(pool, range(7)))
    assert tiers(pool) == {"device": [5, 6], "host": [3, 4], "disk": [0, 1, 2]}
    run(pool.load_from_disk([key(0), key(1)]))  # host full: read into staging, demote 3, 4
    assert tiers(pool) == {"device": [5, 6], "host": [0, 1], "disk": [2, 3, 4]}
    for i in range(7):
        got = run(read(pool, [i]))
        assert got[0].view(torch.uint8).equal(page(i).view(torch.uint8)), f"page {i}"
    assert_slots_consistent(pool)


def test_acquire_promotes_a_disk_page_to_the_top_tier(harness):
    pool = harness.make()
    run(put_each(pool, range(7)))
    assert pool.index[key(0)].tier == DISK
    located = run(pool.acquire([key(0)]))
    slot = pool.index[key(0)].slot
    assert located == [(DEVICE, slot, pool.memory[DEVICE].generation(slot))]
    assert pool.index[key(0)].pins == 1
    assert as_page(pool.memory[DEVICE].view(located[0][1])).equal(page(0))
    pool.release([key(0)])
    assert pool.index[key(0)].pins == 0
    # 0 went disk -> host -> device; room was made by demoting 3 and 5 and 4 one tier, and
    # the full disk dropped its oldest unpinned page, 1
    assert tiers(pool) == {"device": [0, 6], "host": [5], "disk": [2, 3, 4]}
    assert [k for k, t in harness.events if t is None] == [key(1)]
    assert_slots_consistent(pool)


def test_acquire_of_a_prefix_longer_than_memory_returns_what_fits(harness):
    pool = harness.make(disk_pages=8)
    run(put_each(pool, range(7)))
    keys = [key(i) for i in range(7)]
    located = run(pool.acquire(keys))
    assert len(located) == 4  # 2 device + 2 host slots
    assert len({(tier, slot) for tier, slot, _ in located}) == 4
    for i, (tier, slot, _) in enumerate(located):
        assert as_page(pool.memory[tier].view(slot)).equal(page(i))
        assert pool.index[key(i)].pins == 1
    assert all(pool.index[k].pins == 0 for k in keys[4:] if k in pool.index)
    pool.release(keys[:4])
    assert_slots_consistent(pool)


def test_acquire_when_own_pins_fill_host_still_loads_the_whole_prefix(harness):
    pool = harness.make(disk_pages=8)
    run(put_each(pool, range(6)))  # disk [0, 1], host [2, 3], device [4, 5]
    keys = [key(i) for i in (0, 2, 3)]
    located = run(pool.acquire(keys))
    # Lifting 2 and 3 into the device tier makes host room for 0, read up from disk.
    assert len(located) == 3
    for i, (tier, slot, _) in zip((0, 2, 3), located, strict=True):
        assert as_page(pool.memory[tier].view(slot)).equal(page(i))
    for k, (tier, slot, _) in zip(keys, located, strict=False):
        assert pool.index[k].pins == 1
        assert (pool.index[k].tier, pool.index[k].slot) == (tier, slot)
    pool.release(keys[: len(located)])
    assert all(e.pins == 0 for e in pool.index.values())
    assert_slots_consistent(pool)


def test_acquire_returns_the_local_prefix_only(harness):
    pool = harness.make()
    run(put_each(pool, [0, 1, 3]))
    keys = [key(i) for i in range(4)]
    assert pool.local_prefix(keys) == 2
    located = run(pool.acquire(keys))
    assert len(located) == 2
    assert pool.index[key(3)].pins == 0
    pool.release(keys[:2])
    assert run(pool.acquire([key(9)])) == []


def test_acquire_more_disk_pages_than_host_holds(harness):
    pool = harness.make(disk_pages=4)
    run(put_each(pool, range(8)))
    assert tiers(pool)["disk"] == [0, 1, 2, 3]
    keys = [key(i) for i in range(4)]
    calls = count_reads(pool)
    located = run(pool.acquire(keys))
    assert len(located) == 4  # 2 device slots + 2 host slots, all pinned
    assert len({(tier, slot) for tier, slot, _ in located}) == 4
    assert len(calls[0]) == 2  # one batched read fills the host tier
    for i, (tier, slot, _) in enumerate(located):
        assert as_page(pool.memory[tier].view(slot)).equal(page(i))
    pool.release(keys)
    assert_slots_consistent(pool)


@pytest.mark.parametrize(("codec", "payload_blocks"), [("int8", 1), ("fp8", 1)])
def test_quantized_demotion_is_close_not_exact(harness, codec, payload_blocks):
    pool = harness.make(codec=codec)
    run(put_each(pool, range(5)))
    assert pool.index[key(0)].tier == DISK
    assert pool.index[key(0)].codec != 0
    # header block + scales and one byte per element (2080 bytes), rounded to 4096
    assert pool.disk.bytes_written == (1 + payload_blocks) * 4096
    got = run(read(pool, [0]))[0]
    want = page(0)
    assert not got.equal(want)
    amax = want.abs().amax(dim=(-2, -1), keepdim=True)
    error = (got - want).abs()
    if codec == "int8":
        assert bool((error <= amax / 127 / 2 * 1.001 + 1e-7).all())
    else:
        assert bool((error <= want.abs() / 16 + amax / 448 / 8 + 1e-7).all())
    assert pool.index[key(0)].codec == 0  # decoded back into memory
    assert run(read(pool, [4]))[0].equal(page(4))  # pages never on disk stay exact


def test_codec_none_is_exact_on_disk(harness):
    pool = harness.make(codec="none")
    run(put_each(pool, range(5)))
    assert pool.index[key(0)].tier == DISK
    assert pool.disk.bytes_written == DISK_SLOT_BYTES
    assert run(read(pool, [0]))[0].equal(page(0))


def test_concurrent_acquires_share_one_disk_read(harness):
    pool = harness.make()
    run(put_each(pool, range(5)))
    assert pool.index[key(0)].tier == DISK
    calls = count_reads(pool)
    bytes_before = pool.disk.bytes_read

    async def scenario():
        return await asyncio.gather(pool.acquire([key(0)]), pool.acquire([key(0)]))

    first, second = run(scenario())
    assert len(calls) == 1
    assert pool.disk.bytes_read - bytes_before == DISK_SLOT_BYTES
    assert first == second and len(first) == 1
    tier, slot, _ = first[0]
    assert tier in (DEVICE, HOST)
    assert pool.index[key(0)].pins == 2
    assert as_page(pool.memory[tier].view(slot)).equal(page(0))
    pool.release([key(0)])
    pool.release([key(0)])
    assert pool.index[key(0)].pins == 0
    assert len(pool._loads) == 0


async def promote(pool, k, own_pins=0):
    """One page up to the top tier: read up from disk, then lifted into the device tier."""
    await pool.load_from_disk([k])
    await pool.promote_many([k], own_pins)


def test_promote_moves_a_disk_page_to_the_top_tier(harness):
    pool = harness.make()
    run(put_each(pool, range(5)))
    assert tiers(pool) == {"device": [3, 4], "host": [1, 2], "disk": [0]}
    run(promote(pool, key(0)))
    assert pool.index[key(0)].tier == DEVICE
    assert tiers(pool) == {"device": [0, 4], "host": [3], "disk": [1, 2]}
    assert as_page(pool.view(pool.index[key(0)])).equal(page(0))


def test_promote_leaves_a_page_pinned_by_someone_else(harness):
    pool = harness.make()
    run(put_each(pool, range(3)))
    assert pool.index[key(0)].tier == HOST
    pool.index[key(0)].pins = 1
    run(promote(pool, key(0)))
    assert pool.index[key(0)].tier == HOST
    run(promote(pool, key(0), own_pins=1))
    assert pool.index[key(0)].tier == DEVICE


def test_corrupt_disk_page_becomes_a_miss(harness):
    pool = harness.make()
    run(put_each(pool, range(5)))
    entry = pool.index[key(0)]
    assert entry.tier == DISK
    harness.events.clear()
    free_host = pool.memory[HOST].slots.num_free
    flip_disk_byte(pool.disk.dir_path, entry.slot)
    assert run(pool.acquire([key(0), key(1)])) == []
    assert key(0) not in pool.index
    assert [k for k, t in harness.events if t is None] == [key(0)]
    assert pool.index[key(1)].pins == 0
    assert pool.memory[HOST].slots.num_free >= free_host
    assert_slots_consistent(pool)


def test_close_unlinks_shared_memory(harness):
    pool = harness.make()
    # the host slab, both generation tables, the device tier's readers file and the
    # held-pages indexes of the memory tiers and of the disk tier (a device chunk's file
    # comes with its grant)
    assert len(shm_files(harness.prefix)) == 6
    pool.memory[DEVICE].alloc()
    assert len(shm_files(harness.prefix)) == 7
    pool.close()
    assert shm_files(harness.prefix) == []


# ---- restart -----------------------------------------------------------------------------


def test_adopt_disk_pages_indexes_one_copy_per_key(harness):
    pool = harness.make()
    path = pool.disk.dir_path
    raw0, raw1 = page_bytes(0).numpy(), page_bytes(1).numpy()
    pool.disk.write_pages([(0, key(0), 0, raw0), (2, key(0), 0, raw0), (1, key(1), 0, raw1)])
    pool.disk.close()
    pool.disk = DiskArena(path, 3 * DISK_SLOT_BYTES, PAGE_BYTES, 2)
    found = pool.disk.scan()
    assert [slot for slot, _ in found] == [0, 1, 2]
    assert pool.adopt_disk_pages(found) == 2
    assert pool.disk.num_used == 2
    assert tiers(pool) == {"device": [], "host": [], "disk": [0, 1]}
    assert harness.events == [(key(0), DISK), (key(1), DISK)]
    assert run(read(pool, [0, 1]))[1].equal(page(1))
    assert_slots_consistent(pool)
