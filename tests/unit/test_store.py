"""NodeStore: pools per geometry, read leases and reservations (and their expiry), events,
disk recovery after a restart, inventory and stats, Ray-style put_pages/map_pages, prefetch;
and the shared-memory arenas that same-node clients map. Pure asyncio, no Ray.

The harness (Stores, puts into reserved slots, tiers, count_reads) is tests/unit/_pool_harness.py.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
import torch

from cluster.core.geometry import DEVICE, DISK, HOST, PageGeometry
from cluster.core.pool import State
from cluster.core.store import StoreConfig
from cluster.core.tiers.aligned import round_up
from cluster.core.tiers.memory import SHM_DIR, ArenaMapping
from tests.unit._pages import (
    DISK_SLOT_BYTES,
    GEOMETRY,
    PAGE_BYTES,
    as_page,
    flip_disk_byte,
    key,
    page,
    page_bytes,
    shm_files,
)
from tests.unit._pool_harness import (
    Stores,
    assert_slots_consistent,
    count_reads,
    run,
    store_put,
    store_put_each,
    tiers,
    write_pages,
)

G = GEOMETRY


def as_raw(i: int) -> np.ndarray:
    return page_bytes(i).numpy().copy()


def read_pages(store, keys: list[bytes]) -> list[np.ndarray]:
    """Copies of the longest local prefix's pages."""
    return run(store.map_pages(G, keys, np.copy))


# ---- puts, eviction, events ------------------------------------------------------------


def test_put_lands_in_the_top_tier_and_emits_stored(stores):
    store = stores.make()
    assert run(store_put(store, [0, 1])) == 2
    assert store.pool(G).tier_counts() == {"device": 2, "host": 0, "disk": 0}
    assert stores.events(store).drain() == {key(0): DEVICE, key(1): DEVICE}
    assert stores.events(store).drain() == {}


def test_cascade_and_events_keep_the_latest_state_per_key(stores):
    store = stores.make(eviction="lru")
    run(store_put_each(store, range(8)))
    assert tiers(store.pool(G)) == {"device": [6, 7], "host": [4, 5], "disk": [1, 2, 3]}
    assert stores.events(store).drain() == {
        key(0): None, key(1): DISK, key(2): DISK, key(3): DISK,
        key(4): HOST, key(5): HOST, key(6): DEVICE, key(7): DEVICE,
    }


def test_s3fifo_default_cascade(stores):
    store = stores.make(eviction="s3fifo")
    run(store_put_each(store, range(10)))
    assert store.pool(G).tier_counts() == {"device": 2, "host": 2, "disk": 3}
    removed = sorted(k for k, t in stores.events(store).drain().items() if t is None)
    assert removed == [key(0), key(1), key(2)]


def test_reserve_dedups_and_abort_frees(stores):
    store = stores.make()
    run(store_put(store, [0]))
    reservation_id, slots = run(store.reserve(G, [key(0), key(1)]))
    assert slots == [None, (DEVICE, 1)]
    assert store.reservations[reservation_id].keys == [key(1)]  # only what it reserved
    store.abort(reservation_id)
    assert store.reservations == {}
    assert set(store.pool(G).index) == {key(0)}
    assert store.pool(G).memory[DEVICE].slots.num_free == 1
    assert store.inventory() == [(key(0), DEVICE)]


def test_reserve_is_empty_when_everything_is_pinned(stores):
    store = stores.make(host_pages=0)
    run(store_put(store, [0, 1]))
    lease_id, located = run(store.acquire(G, [key(0), key(1)]))
    assert lease_id != 0 and lease_id in store.leases and len(located) == 2
    reservation_id, slots = run(store.reserve(G, [key(2)]))
    assert slots == [] and store.reservations == {}
    assert run(store.put_pages(G, [key(2)], [as_raw(2)])) == 0
    assert key(2) not in store.pool(G).index
    store.release(lease_id)
    reservation_id, slots = run(store.reserve(G, [key(2)]))
    assert slots == [(DEVICE, 0)]  # 0, least recently used, went
    assert store.pool(G).index[key(0)].tier == DISK  # no host tier: straight to disk
    store.abort(reservation_id)


# ---- gets, leases, pins ----------------------------------------------------------------


def test_acquire_release_and_lease_bookkeeping(stores):
    store = stores.make()
    run(store_put(store, [0, 1]))
    lease_id, located = run(store.acquire(G, [key(0), key(1), key(2)]))
    assert lease_id != 0 and list(store.leases) == [lease_id]
    device = store.pool(G).memory[DEVICE]
    slots = [store.pool(G).index[key(i)].slot for i in (0, 1)]
    assert located == [(DEVICE, slot, device.generation(slot)) for slot in slots]
    assert store.leases[lease_id].keys == [key(0), key(1)]
    assert store.pool(G).index[key(0)].pins == 1
    assert run(store.acquire(G, [key(5)])) == (0, [])
    assert len(store.leases) == 1
    store.release(lease_id)
    store.release(lease_id)  # twice is harmless
    assert store.leases == {}
    assert store.pool(G).index[key(0)].pins == 0


def test_pinned_page_survives_pressure_then_can_be_evicted(stores):
    store = stores.make()

    async def fill_while_pinned():
        await store_put(store, [0])
        lease_id, located = await store.acquire(G, [key(0)])
        await store_put_each(store, range(1, 12))
        return lease_id, located

    lease_id, [(tier, slot, _)] = run(fill_while_pinned())
    entry = store.pool(G).index[key(0)]
    assert (entry.tier, entry.slot) == (tier, slot)
    assert as_page(store.pool(G).memory[tier].view(slot)).equal(page(0))
    assert [(e.tier, e.slot) for k, e in store.pool(G).index.items()
            if k != key(0)].count((tier, slot)) == 0
    assert stores.events(store).drain().get(key(0)) == DEVICE
    store.release(lease_id)
    run(store_put_each(store, range(12, 20)))
    assert key(0) not in store.pool(G).index
    assert stores.events(store).drain()[key(0)] is None


def test_lease_expiry_releases_pins_on_the_next_acquire(stores):
    store = stores.make(pin_lease_s=0.01)
    run(store_put(store, [0, 1]))
    lease_id, _ = run(store.acquire(G, [key(0)]))
    assert store.pool(G).index[key(0)].pins == 1
    time.sleep(0.05)
    assert run(store.acquire(G, [key(7)])) == (0, [])
    assert lease_id not in store.leases
    assert store.pool(G).index[key(0)].pins == 0
    assert store.counters["expired_leases"] == 1


def test_expired_leases_do_not_block_puts(stores):
    store = stores.make(pin_lease_s=0.01)
    run(store_put(store, [0, 1]))
    run(store.acquire(G, [key(0), key(1)]))  # a client that never releases
    time.sleep(0.05)
    reservation_id, slots = run(store.reserve(G, [key(2)]))
    assert slots == [(DEVICE, slots[0][1])]
    assert store.leases == {}
    assert store.commit(reservation_id) == 1


def test_concurrent_acquires_share_one_disk_read(stores):
    store = stores.make()
    run(store_put_each(store, range(5)))
    assert tiers(store.pool(G))["disk"] == [0]
    calls = count_reads(store.pool(G))

    async def both():
        return await asyncio.gather(store.acquire(G, [key(0)]), store.acquire(G, [key(0)]))

    (first_id, first), (second_id, second) = run(both())
    assert len(calls) == 1
    assert 0 not in (first_id, second_id) and first_id != second_id
    assert set(store.leases) == {first_id, second_id}
    assert first == second and len(first) == 1
    tier, slot, _ = first[0]
    assert tier in (DEVICE, HOST)
    assert as_page(store.pool(G).memory[tier].view(slot)).equal(page(0))
    assert store.pool(G).index[key(0)].pins == 2
    assert store.counters["hits_disk"] == 2  # both found it on disk (one read served both)
    store.release(first_id)
    store.release(second_id)
    assert store.pool(G).index[key(0)].pins == 0


@pytest.mark.parametrize("codec", ["none", "int8", "fp8"])
def test_round_trip_through_disk(stores, codec):
    store = stores.make(codec=codec)
    run(store_put_each(store, range(5)))
    assert tiers(store.pool(G))["disk"] == [0]
    got = torch.from_numpy(read_pages(store, [key(0)])[0]).view(torch.float32)
    want = page(0).reshape(-1)
    if codec == "none":
        assert got.equal(want)
    else:
        assert not got.equal(want)
        assert float((got - want).abs().max()) <= 0.07 * float(want.abs().max())
    assert store.leases == {}


# ---- recovery after a restart ----------------------------------------------------------


def filled_then_closed(stores: Stores) -> tuple[StoreConfig, dict[int, int]]:
    """A store whose disk holds pages 0, 1, 2; closed as if the node died. -> disk slots."""
    config = stores.config()
    store = stores.make(config)
    run(store_put_each(store, range(7)))
    assert tiers(store.pool(G))["disk"] == [0, 1, 2]
    slots = {i: store.pool(G).index[key(i)].slot for i in range(3)}
    store.close()
    return config, slots


def test_recover_disk_reindexes_pages_byte_exact(stores):
    config, _ = filled_then_closed(stores)
    store = stores.make(config)
    assert store.recover_disk() == 3
    assert sorted(store.inventory()) == [(key(0), DISK), (key(1), DISK), (key(2), DISK)]
    assert stores.events(store).drain() == {key(0): DISK, key(1): DISK, key(2): DISK}
    lease_id, located = run(store.acquire(G, [key(0), key(1), key(2), key(3)]))
    assert len(located) == 3  # 3..6 lived in memory and died with the node
    for i, (tier, slot, _) in enumerate(located):
        assert tier in (DEVICE, HOST)
        assert as_page(store.pool(G).memory[tier].view(slot)).equal(page(i))
    store.release(lease_id)


def test_page_corrupted_on_disk_is_a_miss_after_recovery(stores):
    config, slots = filled_then_closed(stores)
    flip_disk_byte(os.path.join(stores.disk_dir, G.name), slots[1], payload_offset=77)
    store = stores.make(config)
    assert store.recover_disk() == 2
    assert sorted(store.inventory()) == [(key(0), DISK), (key(2), DISK)]
    pages = read_pages(store, [key(0), key(1), key(2)])
    assert len(pages) == 1
    assert np.array_equal(pages[0], as_raw(0))
    assert run(store.acquire(G, [key(1)])) == (0, [])
    assert np.array_equal(read_pages(store, [key(2)])[0], as_raw(2))


def test_page_corrupted_while_running_is_a_miss(stores):
    store = stores.make()
    run(store_put_each(store, range(5)))
    slot = store.pool(G).index[key(0)].slot
    stores.events(store).drain()
    flip_disk_byte(os.path.join(stores.disk_dir, G.name), slot)
    assert read_pages(store, [key(0)]) == []
    assert key(0) not in store.pool(G).index
    assert stores.events(store).drain()[key(0)] is None
    assert store.counters["misses_pages"] == 1


def test_recover_disk_without_a_disk_dir(stores):
    config = stores.config()
    store = stores.make(StoreConfig(config.limits, os.path.join(stores.disk_dir, "none")))
    assert store.recover_disk() == 0
    assert store.pools == {}


def test_store_without_disk_tier_drops_host_victims(stores):
    store = stores.make(disk_pages=0)
    run(store_put_each(store, range(6)))
    assert store.pool(G).disk is None
    assert tiers(store.pool(G)) == {"device": [4, 5], "host": [2, 3], "disk": []}
    assert store.recover_disk() == 0


# ---- prefetch, put_pages / map_pages ---------------------------------------------------


def test_prefetch_promotes_disk_pages_to_memory(stores):
    store = stores.make(disk_pages=8)
    run(store_put_each(store, range(6)))
    assert tiers(store.pool(G))["disk"] == [0, 1]
    assert run(store.prefetch(G, [key(0), key(1), key(9), key(2)])) == 2
    assert store.pool(G).index[key(0)].tier in (DEVICE, HOST)
    assert store.pool(G).index[key(1)].tier in (DEVICE, HOST)
    assert tiers(store.pool(G))["device"] == [0, 1]
    assert all(e.pins == 0 and e.state == State.READY for e in store.pool(G).index.values())
    assert store.leases == {}
    assert run(store.prefetch(G, [key(9)])) == 0
    assert np.array_equal(read_pages(store, [key(0)])[0], as_raw(0))


def test_put_pages_map_pages_round_trip(stores):
    store = stores.make()
    assert run(store.put_pages(G, [key(0), key(1)], [as_raw(0), as_raw(1)])) == 2
    pages = read_pages(store, [key(0), key(1), key(2)])
    assert len(pages) == 2
    assert all(p.dtype == np.uint8 and p.shape == (PAGE_BYTES,) for p in pages)
    assert np.array_equal(pages[0], as_raw(0)) and np.array_equal(pages[1], as_raw(1))
    # dedup: the prefix counts as stored (2 pages) but the stored bytes are not replaced
    assert run(store.put_pages(G, [key(0), key(1)], [as_raw(5), as_raw(5)])) == 2
    assert np.array_equal(read_pages(store, [key(0)])[0], as_raw(0))
    assert run(store.put_pages(G, [key(1), key(2)], [as_raw(1), as_raw(2)])) == 2
    assert stores.events(store).drain()[key(2)] == DEVICE
    assert store.leases == {}
    assert run(store.put_pages(G, [], [])) == 0


def test_put_pages_accepts_typed_arrays_byte_exact(stores):
    store = stores.make()
    typed = page(3).numpy()  # float32 [2, 2, 2, 16, 16], as a non-uint8 array
    assert run(store.put_pages(G, [key(3)], [typed])) == 1
    assert np.array_equal(read_pages(store, [key(3)])[0], as_raw(3))


def test_put_pages_of_the_wrong_size_stores_nothing(stores):
    store = stores.make()
    with pytest.raises(ValueError, match="8192"):
        run(store.put_pages(G, [key(0), key(1)], [as_raw(0), as_raw(1)[:100]]))
    assert store.pool(G).index == {}
    assert store.pool(G).memory[DEVICE].slots.num_free == 2
    assert stores.events(store).drain() == {}


def test_put_pages_does_not_commit_another_clients_reservation(stores):
    store = stores.make()
    other_id, slots = run(store.reserve(G, [key(0)]))  # a same-node put in flight
    assert slots == [(DEVICE, 0)]
    # key 0 is not stored until that put commits: the stored prefix stops there
    assert run(store.put_pages(G, [key(0), key(1)], [as_raw(0), as_raw(1)])) == 0
    entry = store.pool(G).index[key(0)]
    assert (entry.state, entry.owner, entry.tier, entry.slot) == (State.PENDING, other_id,
                                                                  DEVICE, 0)
    assert store.pool(G).local_prefix([key(0)]) == 0
    assert key(1) not in store.pool(G).index
    assert list(store.reservations) == [other_id]
    assert stores.events(store).drain() == {}
    # the other client's reservation is still its own to commit
    write_pages(store.pool(G), [0], slots)
    assert store.commit(other_id) == 1
    assert np.array_equal(read_pages(store, [key(0)])[0], as_raw(0))


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
        "evictions": {"device": 3, "host": 1, "disk": 0}, "disk_read_us_per_token": 0.0,
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
    # 2 pools x (2 arenas x (slab + generation table) + a held-pages index), less the device
    # chunk that the second pool has not been granted yet (a device chunk is a file of its own)
    assert len(shm_files(prefix)) == 9
    store.close()
    assert shm_files(prefix) == []


# ---- reservations expire (a client that dies mid-put) -----------------------------------


def test_a_reservation_never_committed_expires(stores):
    store = stores.make(reserve_lease_s=0.01)
    pool = store.pool(G)
    stale_id, slots = run(store.reserve(G, [key(0)]))  # the client dies before its commit
    assert slots == [(DEVICE, 0)]
    write_pages(pool, [5], slots)  # ... having written something else
    time.sleep(0.05)
    assert run(store.put_pages(G, [key(0)], [as_raw(0)])) == 1
    assert pool.local_prefix([key(0)]) == 1
    assert store.commit(stale_id) == 0
    assert np.array_equal(read_pages(store, [key(0)])[0], as_raw(0))
    stats = store.stats()
    assert stats["expired_reservations"] == 1 and stats["reservations"] == 0
    assert stats["puts"] == 1
    # no slot leaked: one page stored, the rest free
    assert pool.memory[DEVICE].slots.num_free == 1
    assert pool.memory[HOST].slots.num_free == 2
    assert_slots_consistent(pool)


def test_an_expired_reservation_cannot_commit_over_a_newer_one(stores):
    store = stores.make(reserve_lease_s=0.01)
    first_id, _ = run(store.reserve(G, [key(0)]))
    time.sleep(0.05)
    assert store.expire() == 1
    assert key(0) not in store.pool(G).index
    second_id, slots = run(store.reserve(G, [key(0)]))
    assert second_id != first_id and len(slots) == 1 and slots[0] is not None
    assert store.commit(first_id) == 0
    entry = store.pool(G).index[key(0)]
    assert (entry.state, entry.owner) == (State.PENDING, second_id)
    assert store.pool(G).local_prefix([key(0)]) == 0
    assert store.commit(second_id) == 1
    assert store.pool(G).local_prefix([key(0)]) == 1


def test_a_page_pending_under_another_reservation_is_not_reported_stored(stores):
    store = stores.make()  # leases long enough not to expire here
    first_id, slots = run(store.reserve(G, [key(0)]))
    assert slots == [(DEVICE, 0)]
    second_id, slots = run(store.reserve(G, [key(0), key(1)]))
    assert slots == []  # the prefix stops at key 0
    assert second_id not in store.reservations
    assert key(1) not in store.pool(G).index  # what it placed past the prefix was undone
    assert store.pool(G).index[key(0)].owner == first_id
    assert_slots_consistent(store.pool(G))


def test_expire_returns_how_many_leases_and_reservations_it_ended(stores):
    store = stores.make()
    pool = store.pool(G)
    run(store_put(store, [0, 1]))
    lease_id, located = run(store.acquire(G, [key(0)]))
    assert len(located) == 1
    reserved = [run(store.reserve(G, [key(i)]))[0] for i in (5, 6)]
    assert store.expire() == 0  # nothing is due yet
    assert store.expire(time.monotonic() + 1.0) == 0
    assert store.expire(time.monotonic() + 60.0) == 3
    assert lease_id not in store.leases and pool.index[key(0)].pins == 0
    assert store.reservations == {}
    assert key(5) not in pool.index and key(6) not in pool.index
    assert [store.commit(i) for i in reserved] == [0, 0]
    assert store.expire(time.monotonic() + 60.0) == 0
    assert (store.counters["expired_leases"], store.counters["expired_reservations"]) == (1, 2)
    assert_slots_consistent(pool)


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
