"""NodeStore's pools: inventory and stats, pools per geometry and the limits on geometries, slot
generations, and the shared-memory arenas that same-node clients map. Pure asyncio, no Ray.

The harness (Stores, puts into reserved slots, tiers, count_reads) is tests/unit/_pool_harness.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from cluster.core.geometry import DEVICE, DISK, HOST, PageGeometry
from cluster.core.tiers.aligned import round_up
from cluster.core.tiers.memory import SHM_DIR, ArenaMapping
from tests.unit._pages import (
    DISK_SLOT_BYTES,
    GEOMETRY,
    PAGE_BYTES,
    as_page,
    key,
    page,
    shm_files,
)
from tests.unit._pool_harness import (
    as_raw,
    read_pages,
    run,
    store_put,
    store_put_each,
)

G = GEOMETRY


# ---- inventory and stats ---------------------------------------------------------------


def test_inventory_lists_ready_pages_only(stores):
    store = stores.make()
    run(store_put_each(store, range(5)))
    run(store.reserve(G, [key(9)]))
    # reserving 9 demoted 3 to host and 1 to disk; 9 itself is pending, so not listed
    assert sorted(store.inventory()) == [(key(0), DISK), (key(1), DISK), (key(2), HOST),
                                         (key(3), HOST), (key(4), DEVICE)]


def test_stats_figures(stores):
    store = stores.make()
    run(store_put_each(store, range(5)))
    lease_id, _ = run(store.acquire(G, [key(4), key(3), key(8)]))
    stats = store.stats()
    memory, models = stats.pop("memory"), stats.pop("models")
    assert stats["ready_on_path_s"] > 0  # timed: the chunks' memory was faulted in
    assert models == {G.name: 2 * PAGE_BYTES + 2 * PAGE_BYTES + DISK_SLOT_BYTES}
    assert memory["tiers"]["host"]["models"] == {G.name: 2 * PAGE_BYTES}
    assert memory["tiers"]["disk"]["namespaces"] == {"": DISK_SLOT_BYTES}
    assert stats == {
        "pages": {"device": 2, "host": 2, "disk": 1},
        "bytes": {"device": 2 * PAGE_BYTES, "host": 2 * PAGE_BYTES, "disk": PAGE_BYTES},
        "leases": 1, "reservations": 0, "quarantined_slots": 0, "quarantine_freed_slots": 0,
        "puts": 5, "gets": 1, "hits_pages": 2,
        "hits_device": 2, "hits_host": 0, "hits_disk": 0,  # where each hit was found
        "misses_pages": 1, "expired_reservations": 0, "expired_leases": 0,
            "optimistic_hits_pages": 0, "optimistic_reads": 0,
        "leased_slots": 0, "leased_puts": 0, "leased_pages": 0, "leased_duplicates": 0,
        "lapsed_commits": 0, "expired_slot_leases": 0,  # leased puts: test_put_leases.py
        "revoked_leased_slots": 0, "leased_over_namespace_max": 0,
        "written_leased_slots_kept": 0,
        "disk_bytes_read": 0, "disk_bytes_written": DISK_SLOT_BYTES,  # one page, header incl.
        "disk_checksum_failures": 0,
        # demotion ahead of need keeps a quarter of the 2 host pages free: none
        "host_headroom_pages": 0, "host_headroom_short_pages": 0, "demoted_ahead_pages": 0,
        # no node loop here to hash pages ahead: the one page demoted to disk was hashed as
        # it was written; the 3 pages that came down to host are still queued
        "checksums_ahead_pages": 0, "inline_checksum_pages": 1, "checksum_queued_pages": 3,
        # every chunk the memory tiers hold was faulted in on a put's path (no node loop
        # here readies chunks ahead)
        "ready_on_path_chunks": sum(arena.slots.num_held_chunks
                                    for arena in store.pools[G].memory),
        "ready_on_path_s": stats["ready_on_path_s"],
        "chunk_grant_failures": 0,  # every chunk's memory was there to be had
        "retired_chunk_bytes": 0,  # no device chunk given back while a client mapped it
        "evictions": {"device": 3, "host": 1, "disk": 0}, "disk_read_us_per_token": 0.0,
        "disk_read_s": 0.0,  # no page read up from disk yet
        "pins": {"pins": 0, "pinned_pages": 0, "pinned_bytes": 0, "expired_pins": 0,
                 "cap_bytes": 2 * PAGE_BYTES},  # half of the 2 + 2 memory pages
    }
    store.release(lease_id)
    assert store.stats()["leases"] == 0


def test_pools_per_geometry(stores):
    store = stores.make()
    other = PageGeometry((1, 2, 1, 16, 16), "float32")  # 2048-byte pages
    run(store_put(store, [0]))
    reservation_id, slots = run(store.reserve(other, [key(0)]))
    assert slots == [(DEVICE, 0)]
    assert store.commit(reservation_id) == 1
    assert set(store.pools) == {G, other}
    assert store.stats()["pages"] == {"device": 2, "host": 0, "disk": 0}
    assert store.stats()["bytes"]["device"] == PAGE_BYTES + 2048
    assert sorted(os.listdir(stores.disk_dir)) == sorted([G.name, other.name])
    assert len(store.descriptors(other)) == 2


# ---- shared-memory arenas --------------------------------------------------------------


def test_mapped_arena_and_client_mapping_share_bytes(stores):
    store = stores.make()
    run(store_put(store, [0]))
    device, host = store.descriptors(G)
    assert (device.tier, host.tier) == ("device", "host")
    assert device.slot_bytes == host.slot_bytes == round_up(PAGE_BYTES)
    assert device.num_slots == host.num_slots == 2
    # the device tier: a shm file per chunk (the CPU stand-in of VRAM chunks); host: one slab
    assert device.shm_path is None and host.shm_path.startswith(SHM_DIR + "/")
    assert [c.shm_path.startswith(SHM_DIR + "/") for c in device.device_layout.chunks] == [True]
    assert device.generations_path.startswith(SHM_DIR + "/")
    mapping = ArenaMapping(device)
    slot = store.pool(G).index[key(0)].slot
    assert as_page(mapping.view(slot)).equal(page(0))
    mapping.view(slot)[:4].copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    assert store.pool(G).memory[DEVICE].view(slot)[:4].tolist() == [1, 2, 3, 4]


def test_new_store_removes_stale_slabs_of_its_prefix(stores):
    config = stores.config()
    stale = os.path.join(SHM_DIR, f"{config.limits.shm_prefix}-host-deadbeef")
    with open(stale, "wb") as handle:
        handle.write(b"x")
    stores.make(config)
    assert not os.path.exists(stale)


def test_close_unlinks_every_slab(stores):
    store = stores.make()
    run(store_put(store, [0]))
    store.pool(PageGeometry((1, 2, 1, 16, 16), "float32"))
    prefix = store.config.limits.shm_prefix
    # 2 pools x (2 arenas x (slab + generation table) + the device tier's readers file + two
    # held-pages indexes: the memory tiers' and the disk tier's), less the device chunk that
    # the second pool has not been granted yet (a device chunk is a file of its own)
    assert len(shm_files(prefix)) == 13
    store.close()
    assert shm_files(prefix) == []


# ---- geometries --------------------------------------------------------------------------


def test_max_geometries_refuses_a_new_geometry_and_creates_nothing(stores):
    store = stores.make(max_geometries=1)
    store.pool(G)
    prefix = store.config.limits.shm_prefix
    shm_before = sorted(shm_files(prefix))
    disk_before = sorted(os.listdir(stores.disk_dir))
    other = PageGeometry((1, 2, 1, 16, 16), "float32")
    with pytest.raises(ValueError, match="max_geometries"):
        store.pool(other)
    with pytest.raises(ValueError, match="max_geometries"):
        run(store.reserve(other, [key(0)]))
    assert sorted(shm_files(prefix)) == shm_before
    assert sorted(os.listdir(stores.disk_dir)) == disk_before
    assert list(store.pools) == [G]
    assert store.pool(G) is store.pools[G]  # a known geometry is still served


def test_a_geometry_whose_page_no_tier_holds_is_refused_and_creates_nothing(stores):
    """Every put of such a model would store nothing, silently: refused by name instead."""
    store = stores.make()
    limits = store.config.limits
    tier_bytes = max(limits.device_bytes, limits.host_bytes, limits.disk_bytes)
    huge = PageGeometry((1, 2, 1, tier_bytes // 64 + 1, 16), "float32")
    assert huge.slot_bytes > tier_bytes
    with pytest.raises(ValueError, match="more than any tier of this node holds"):
        store.pool(huge)
    assert huge not in store.pools
    store.pool(G)  # a page that fits is served


@pytest.mark.parametrize("geometry", [
    PageGeometry((2, 2, 16, 16), "float32"),  # 4 dims
    PageGeometry((2, 2, 0, 16, 16), "float32"),  # zero
    PageGeometry((2, 2, -2, 16, 16), "float32"),  # negative
    PageGeometry((2, True, 2, 16, 16), "float32"),  # bool
    PageGeometry((2, 2.0, 2, 16, 16), "float32"),  # float
    PageGeometry((2, 2, 2, 16, 16), "float64"),  # unknown dtype
    PageGeometry((2, 2, 2, 16, 16), "nope"),  # unknown dtype
], ids=["four-dims", "zero", "negative", "bool", "float", "float64", "unknown"])
def test_bad_geometries_are_refused(stores, geometry):
    store = stores.make()
    with pytest.raises(ValueError):
        store.pool(geometry)
    assert store.pools == {}
    assert shm_files(store.config.limits.shm_prefix) == []


# ---- slot generations --------------------------------------------------------------------


def test_a_slot_generation_changes_when_its_page_moves_out(stores):
    store = stores.make(eviction="lru")
    pool = store.pool(G)
    run(store_put(store, [0]))
    lease_id, [(tier, slot, gen)] = run(store.acquire(G, [key(0)]))
    assert tier == DEVICE and gen == pool.memory[DEVICE].generation(slot)
    mapping = ArenaMapping(store.descriptors(G)[DEVICE])
    assert mapping.generation(slot) == gen
    store.release(lease_id)
    run(store_put_each(store, [1, 2]))  # fills the device tier: 0 is demoted to host
    assert pool.index[key(0)].tier == HOST
    assert pool.memory[DEVICE].generation(slot) != gen
    assert pool.memory[DEVICE].generation(slot) == gen + 1  # freed exactly once
    assert mapping.generation(slot) == gen + 1  # clients see it through the shm table
    # an aborted reservation's slot is fenced (a writer that has not locked it yet then
    # writes nothing), then freed: its generation moves twice
    reservation_id, [(tier, slot)] = run(store.reserve(G, [key(3)], HOST))
    before = pool.memory[tier].generation(slot)
    store.abort(reservation_id)
    assert pool.memory[tier].generation(slot) == before + 2


def test_a_chunk_is_readied_ahead_for_the_pool_that_puts_only(stores):
    import dataclasses

    other = PageGeometry((2, 2, 2, 16, 32), "float32")
    config = dataclasses.replace(stores.config(device_pages=0, host_pages=4),
                                 chunk_bytes=2 * PAGE_BYTES)
    store = stores.make(config)
    store.pool(other)
    assert run(store_put(store, [0])) == 1
    host = store.pool(G).memory[HOST]
    assert host.slots.num_held_chunks == 1
    assert run(store.grow_ahead(G)) == 1  # one free slot left: less than a chunk's worth
    assert host.slots.num_held_chunks == 2 and host.held[1] > 0
    assert run(store.grow_ahead(G)) == 0  # three free slots now: enough
    assert store.pool(other).memory[HOST].slots.num_held_chunks == 0
    assert run(store_put(store, [1, 2, 3])) == 3  # the readied slots are used


def test_a_put_that_needs_a_new_chunk_faults_it_in_off_the_event_loop(stores, monkeypatch):
    """A reserve that finds no held slot free waits for a chunk's memory, but in a thread: the
    node's other requests go on meanwhile (on this VM a fault-in of memory the host had not
    backed took 200 ms a 64 MiB chunk), and the wait is counted as on the path."""
    import asyncio
    import threading
    import time

    from cluster.core.tiers.memory import MappedArena

    store = stores.make()
    threads, slow_ready = [], MappedArena.ready_chunk

    def ready_chunk(arena, chunk):
        threads.append(threading.current_thread() is threading.main_thread())
        time.sleep(0.05)
        slow_ready(arena, chunk)

    monkeypatch.setattr(MappedArena, "ready_chunk", ready_chunk)

    async def put_beside_a_ticker() -> int:
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        ticking = asyncio.ensure_future(ticker())
        await store_put(store, [0])
        ticking.cancel()
        return ticks

    ticks = run(put_beside_a_ticker())
    assert threads and not any(threads)  # every chunk of the put readied off the loop thread
    assert ticks >= 5  # the loop kept running through the 50 ms fault-in
    stats = store.stats()
    assert stats["ready_on_path_chunks"] == len(threads) and stats["ready_on_path_s"] >= 0.05
    assert read_pages(store, [key(0)])[0].tobytes() == as_raw(0).tobytes()


def test_device_memory_the_gpu_cannot_give_is_no_room_and_puts_land_in_host(stores, monkeypatch):
    """A VRAM chunk is allocated when a pool first needs it, long after the start-up budget
    check; by then an engine may have taken the memory. cudaMalloc's error (a RuntimeError
    from cupy) went up through the put's reserve, and the put stored nothing. Now such a
    chunk is no room: the pages go to host memory, readying ahead stops short, and the
    failures are counted."""
    from cluster.core.tiers.memory import MappedArena

    store = stores.make()
    ready = MappedArena.ready_chunk

    def ready_chunk(arena, chunk):
        if arena.tier == "device":
            raise RuntimeError("cudaErrorMemoryAllocation: out of memory")
        ready(arena, chunk)

    monkeypatch.setattr(MappedArena, "ready_chunk", ready_chunk)
    run(store_put_each(store, range(3)))  # each put stores its page
    assert run(store.grow_ahead(G)) >= 0  # readying ahead stops short of the device tier
    stats = store.stats()
    assert stats["pages"]["device"] == 0 and stats["pages"]["host"] + stats["pages"]["disk"] == 3
    assert stats["chunk_grant_failures"] >= 2  # on a put's path and ahead of need
    assert store.pools[G].memory[DEVICE].slots.budget.used_bytes == 0  # all given back
    assert len(read_pages(store, [key(i) for i in range(3)])) >= 1
