"""NodeStore: pools per geometry, leases, the event buffer, disk recovery after a restart,
inventory and stats, Ray-style put_pages/read_pages, prefetch; and the shared-memory arenas
that same-node clients map. Pure asyncio, no Ray."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
import torch

from cluster.core.geometry import DEVICE, DISK, HOST, PageGeometry
from cluster.core.pool import PoolLimits, State
from cluster.core.store import NodeStore, StoreConfig
from cluster.core.tiers.memory import ArenaMapping, round_up
from tests.unit._pages import (
    DISK_SLOT_BYTES,
    GEOMETRY,
    PAGE_BYTES,
    SHM_DIR,
    as_page,
    flip_disk_byte,
    key,
    make_disk_dir,
    page,
    page_bytes,
    remove_dir,
    shm_files,
    unique_prefix,
)

G = GEOMETRY


class Stores:
    """Builds NodeStores over one temp disk dir; closes them all at teardown."""

    def __init__(self) -> None:
        self.disk_dir = make_disk_dir()
        self.prefixes: list[str] = []
        self.stores: list[NodeStore] = []

    def config(self, device_pages=2, host_pages=2, disk_pages=3, codec="none",
               eviction="lru", pin_lease_s=30.0) -> StoreConfig:
        prefix = unique_prefix()
        self.prefixes.append(prefix)
        limits = PoolLimits(device_pages * PAGE_BYTES, host_pages * PAGE_BYTES,
                            disk_pages * DISK_SLOT_BYTES, eviction, codec, False, prefix)
        return StoreConfig(limits, self.disk_dir, pin_lease_s, 2)

    def make(self, config: StoreConfig | None = None, **kwargs) -> NodeStore:
        store = NodeStore(config or self.config(**kwargs))
        self.stores.append(store)
        return store

    def close(self) -> None:
        for store in self.stores:
            store.close()
        remove_dir(self.disk_dir)


@pytest.fixture
def stores():
    s = Stores()
    yield s
    s.close()
    for prefix in s.prefixes:
        assert shm_files(prefix) == []


def run(coro):
    return asyncio.run(coro)


async def put(store: NodeStore, ids: list[int], geometry: PageGeometry = G) -> int:
    """A same-node client's put: reserve, write into the mapped slot, commit."""
    keys = [key(i) for i in ids]
    slots = await store.reserve(geometry, keys)
    assert slots, "no room"
    pool = store.pool(geometry)
    for i, slot in zip(ids, slots, strict=True):
        if slot is not None:
            pool.memory[slot[0]].view(slot[1])[:PAGE_BYTES].copy_(page_bytes(i))
    return store.commit(geometry, keys)


async def put_each(store: NodeStore, ids) -> None:
    for i in ids:
        assert await put(store, [i]) == 1


def tiers(store: NodeStore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"device": [], "host": [], "disk": []}
    names = {DEVICE: "device", HOST: "host", DISK: "disk"}
    for k, entry in store.pool(G).index.items():
        out[names[entry.tier]].append(int.from_bytes(k[1:], "little"))
    return {name: sorted(ids) for name, ids in out.items()}


def as_raw(i: int) -> np.ndarray:
    return page_bytes(i).numpy().copy()


def count_reads(store: NodeStore) -> list[list[int]]:
    disk = store.pool(G).disk
    calls: list[list[int]] = []
    original = disk.read_pages

    def counting(slots, outs):
        calls.append(list(slots))
        return original(slots, outs)

    disk.read_pages = counting
    return calls


# ---- puts, eviction, events ------------------------------------------------------------


def test_put_lands_in_the_top_tier_and_emits_stored(stores):
    store = stores.make()
    assert run(put(store, [0, 1])) == 2
    assert store.pool(G).tier_counts() == {"device": 2, "host": 0, "disk": 0}
    assert store.events.drain() == {key(0): DEVICE, key(1): DEVICE}
    assert store.events.drain() == {}


def test_cascade_and_events_keep_the_latest_state_per_key(stores):
    store = stores.make(eviction="lru")
    run(put_each(store, range(8)))
    assert tiers(store) == {"device": [6, 7], "host": [4, 5], "disk": [1, 2, 3]}
    assert store.events.drain() == {
        key(0): None, key(1): DISK, key(2): DISK, key(3): DISK,
        key(4): HOST, key(5): HOST, key(6): DEVICE, key(7): DEVICE,
    }


def test_s3fifo_default_cascade(stores):
    store = stores.make(eviction="s3fifo")
    run(put_each(store, range(10)))
    assert store.pool(G).tier_counts() == {"device": 2, "host": 2, "disk": 3}
    removed = sorted(k for k, t in store.events.drain().items() if t is None)
    assert removed == [key(0), key(1), key(2)]


def test_reserve_dedups_and_abort_frees(stores):
    store = stores.make()
    run(put(store, [0]))
    slots = run(store.reserve(G, [key(0), key(1)]))
    assert slots == [None, (DEVICE, 1)]
    store.pool(G).abort([key(0), key(1)])
    assert set(store.pool(G).index) == {key(0)}
    assert store.pool(G).memory[DEVICE].slots.num_free == 1
    assert store.inventory() == [(key(0), DEVICE)]


def test_reserve_is_empty_when_everything_is_pinned(stores):
    store = stores.make(host_pages=0)
    run(put(store, [0, 1]))
    lease_id, located = run(store.acquire(G, [key(0), key(1)]))
    assert lease_id == 1 and len(located) == 2
    assert run(store.reserve(G, [key(2)])) == []
    assert run(store.put_pages(G, [key(2)], [as_raw(2)])) == 0
    assert key(2) not in store.pool(G).index
    store.release(lease_id)
    assert run(store.reserve(G, [key(2)])) == [(DEVICE, 0)]  # 0, least recently used, went
    assert store.pool(G).index[key(0)].tier == DISK  # no host tier: straight to disk


# ---- gets, leases, pins ----------------------------------------------------------------


def test_acquire_release_and_lease_bookkeeping(stores):
    store = stores.make()
    run(put(store, [0, 1]))
    lease_id, located = run(store.acquire(G, [key(0), key(1), key(2)]))
    assert lease_id == 1
    assert located == [(DEVICE, store.pool(G).index[key(0)].slot),
                       (DEVICE, store.pool(G).index[key(1)].slot)]
    assert store.leases[1].keys == [key(0), key(1)]
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
        await put(store, [0])
        lease_id, located = await store.acquire(G, [key(0)])
        await put_each(store, range(1, 12))
        return lease_id, located

    lease_id, [(tier, slot)] = run(fill_while_pinned())
    entry = store.pool(G).index[key(0)]
    assert (entry.tier, entry.slot) == (tier, slot)
    assert as_page(store.pool(G).memory[tier].view(slot)).equal(page(0))
    assert [(e.tier, e.slot) for k, e in store.pool(G).index.items()
            if k != key(0)].count((tier, slot)) == 0
    assert store.events.drain().get(key(0)) == DEVICE
    store.release(lease_id)
    run(put_each(store, range(12, 20)))
    assert key(0) not in store.pool(G).index
    assert store.events.drain()[key(0)] is None


def test_lease_expiry_releases_pins_on_the_next_acquire(stores):
    store = stores.make(pin_lease_s=0.01)
    run(put(store, [0, 1]))
    lease_id, _ = run(store.acquire(G, [key(0)]))
    assert store.pool(G).index[key(0)].pins == 1
    time.sleep(0.05)
    assert run(store.acquire(G, [key(7)])) == (0, [])
    assert lease_id not in store.leases
    assert store.pool(G).index[key(0)].pins == 0


def test_expired_leases_do_not_block_puts(stores):
    store = stores.make(pin_lease_s=0.01)
    run(put(store, [0, 1]))
    run(store.acquire(G, [key(0), key(1)]))  # a client that never releases
    time.sleep(0.05)
    slots = run(store.reserve(G, [key(2)]))
    assert slots == [(DEVICE, slots[0][1])]
    assert store.leases == {}
    assert store.commit(G, [key(2)]) == 1


def test_concurrent_acquires_share_one_disk_read(stores):
    store = stores.make()
    run(put_each(store, range(5)))
    assert tiers(store)["disk"] == [0]
    calls = count_reads(store)

    async def both():
        return await asyncio.gather(store.acquire(G, [key(0)]), store.acquire(G, [key(0)]))

    (first_id, first), (second_id, second) = run(both())
    assert len(calls) == 1
    assert {first_id, second_id} == {1, 2}
    assert first == second and len(first) == 1
    tier, slot = first[0]
    assert tier in (DEVICE, HOST)
    assert as_page(store.pool(G).memory[tier].view(slot)).equal(page(0))
    assert store.pool(G).index[key(0)].pins == 2
    store.release(first_id)
    store.release(second_id)
    assert store.pool(G).index[key(0)].pins == 0


@pytest.mark.parametrize("codec", ["none", "int8", "fp8"])
def test_round_trip_through_disk(stores, codec):
    store = stores.make(codec=codec)
    run(put_each(store, range(5)))
    assert tiers(store)["disk"] == [0]
    got = torch.from_numpy(run(store.read_pages(G, [key(0)]))[0]).view(torch.float32)
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
    run(put_each(store, range(7)))
    assert tiers(store)["disk"] == [0, 1, 2]
    slots = {i: store.pool(G).index[key(i)].slot for i in range(3)}
    store.close()
    return config, slots


def test_recover_disk_reindexes_pages_byte_exact(stores):
    config, _ = filled_then_closed(stores)
    store = stores.make(config)
    assert store.recover_disk() == 3
    assert sorted(store.inventory()) == [(key(0), DISK), (key(1), DISK), (key(2), DISK)]
    assert store.events.drain() == {key(0): DISK, key(1): DISK, key(2): DISK}
    lease_id, located = run(store.acquire(G, [key(0), key(1), key(2), key(3)]))
    assert len(located) == 3  # 3..6 lived in memory and died with the node
    for i, (tier, slot) in enumerate(located):
        assert tier in (DEVICE, HOST)
        assert as_page(store.pool(G).memory[tier].view(slot)).equal(page(i))
    store.release(lease_id)


def test_page_corrupted_on_disk_is_a_miss_after_recovery(stores):
    config, slots = filled_then_closed(stores)
    flip_disk_byte(os.path.join(stores.disk_dir, G.name), slots[1], payload_offset=77)
    store = stores.make(config)
    assert store.recover_disk() == 2
    assert sorted(store.inventory()) == [(key(0), DISK), (key(2), DISK)]
    pages = run(store.read_pages(G, [key(0), key(1), key(2)]))
    assert len(pages) == 1
    assert np.array_equal(pages[0], as_raw(0))
    assert run(store.acquire(G, [key(1)])) == (0, [])
    assert np.array_equal(run(store.read_pages(G, [key(2)]))[0], as_raw(2))


def test_page_corrupted_while_running_is_a_miss(stores):
    store = stores.make()
    run(put_each(store, range(5)))
    slot = store.pool(G).index[key(0)].slot
    store.events.drain()
    flip_disk_byte(os.path.join(stores.disk_dir, G.name), slot)
    assert run(store.read_pages(G, [key(0)])) == []
    assert key(0) not in store.pool(G).index
    assert store.events.drain()[key(0)] is None
    assert store.counters["misses_pages"] == 1


def test_recover_disk_without_a_disk_dir(stores):
    config = stores.config()
    store = stores.make(StoreConfig(config.limits, os.path.join(stores.disk_dir, "none")))
    assert store.recover_disk() == 0
    assert store.pools == {}


def test_store_without_disk_tier_drops_host_victims(stores):
    store = stores.make(disk_pages=0)
    run(put_each(store, range(6)))
    assert store.pool(G).disk is None
    assert tiers(store) == {"device": [4, 5], "host": [2, 3], "disk": []}
    assert store.recover_disk() == 0


# ---- prefetch, put_pages / read_pages --------------------------------------------------


def test_prefetch_promotes_disk_pages_to_memory(stores):
    store = stores.make(disk_pages=8)
    run(put_each(store, range(6)))
    assert tiers(store)["disk"] == [0, 1]
    assert run(store.prefetch(G, [key(0), key(1), key(9), key(2)])) == 2
    assert store.pool(G).index[key(0)].tier in (DEVICE, HOST)
    assert store.pool(G).index[key(1)].tier in (DEVICE, HOST)
    assert tiers(store)["device"] == [0, 1]
    assert all(e.pins == 0 and e.state == State.READY for e in store.pool(G).index.values())
    assert store.leases == {}
    assert run(store.prefetch(G, [key(9)])) == 0
    assert np.array_equal(run(store.read_pages(G, [key(0)]))[0], as_raw(0))


def test_put_pages_read_pages_round_trip(stores):
    store = stores.make()
    assert run(store.put_pages(G, [key(0), key(1)], [as_raw(0), as_raw(1)])) == 2
    pages = run(store.read_pages(G, [key(0), key(1), key(2)]))
    assert len(pages) == 2
    assert all(p.dtype == np.uint8 and p.shape == (PAGE_BYTES,) for p in pages)
    assert np.array_equal(pages[0], as_raw(0)) and np.array_equal(pages[1], as_raw(1))
    # dedup: the prefix counts as stored (2 pages) but the stored bytes are not replaced
    assert run(store.put_pages(G, [key(0), key(1)], [as_raw(5), as_raw(5)])) == 2
    assert np.array_equal(run(store.read_pages(G, [key(0)]))[0], as_raw(0))
    assert run(store.put_pages(G, [key(1), key(2)], [as_raw(1), as_raw(2)])) == 2
    assert store.events.drain()[key(2)] == DEVICE
    assert store.leases == {}
    assert run(store.put_pages(G, [], [])) == 0


def test_put_pages_accepts_typed_arrays_byte_exact(stores):
    store = stores.make()
    typed = page(3).numpy()  # float32 [2, 2, 2, 16, 16], as a non-uint8 array
    assert run(store.put_pages(G, [key(3)], [typed])) == 1
    assert np.array_equal(run(store.read_pages(G, [key(3)]))[0], as_raw(3))


def test_put_pages_of_the_wrong_size_stores_nothing(stores):
    store = stores.make()
    with pytest.raises(ValueError, match="8192"):
        run(store.put_pages(G, [key(0), key(1)], [as_raw(0), as_raw(1)[:100]]))
    assert store.pool(G).index == {}
    assert store.pool(G).memory[DEVICE].slots.num_free == 2
    assert store.events.drain() == {}


def test_put_pages_does_not_commit_another_clients_reservation(stores):
    store = stores.make()
    assert run(store.reserve(G, [key(0)])) == [(DEVICE, 0)]  # a same-node put in flight
    assert run(store.put_pages(G, [key(0), key(1)], [as_raw(0), as_raw(1)])) == 2  # prefix
    assert store.pool(G).index[key(0)].state == State.PENDING
    assert store.pool(G).local_prefix([key(0)]) == 0
    assert store.pool(G).index[key(1)].state == State.READY


# ---- inventory and stats ---------------------------------------------------------------


def test_inventory_lists_ready_pages_only(stores):
    store = stores.make()
    run(put_each(store, range(5)))
    run(store.reserve(G, [key(9)]))
    # reserving 9 demoted 3 to host and 1 to disk; 9 itself is pending, so not listed
    assert sorted(store.inventory()) == [(key(0), DISK), (key(1), DISK), (key(2), HOST),
                                         (key(3), HOST), (key(4), DEVICE)]


def test_stats_figures(stores):
    store = stores.make()
    run(put_each(store, range(5)))
    lease_id, _ = run(store.acquire(G, [key(4), key(3), key(8)]))
    stats = store.stats()
    assert stats == {
        "pages": {"device": 2, "host": 2, "disk": 1},
        "bytes": {"device": 2 * PAGE_BYTES, "host": 2 * PAGE_BYTES, "disk": PAGE_BYTES},
        "leases": 1, "puts": 5, "gets": 1, "hits_pages": 2, "misses_pages": 1,
    }
    store.release(lease_id)
    assert store.stats()["leases"] == 0


def test_pools_per_geometry(stores):
    store = stores.make()
    other = PageGeometry((1, 2, 1, 16, 16), "float32")  # 2048-byte pages
    run(put(store, [0]))
    slots = run(store.reserve(other, [key(0)]))
    assert slots == [(DEVICE, 0)]
    store.commit(other, [key(0)])
    assert set(store.pools) == {G, other}
    assert store.stats()["pages"] == {"device": 2, "host": 0, "disk": 0}
    assert store.stats()["bytes"]["device"] == PAGE_BYTES + 2048
    assert sorted(os.listdir(stores.disk_dir)) == sorted([G.name, other.name])
    assert len(store.descriptors(other)) == 2


# ---- shared-memory arenas --------------------------------------------------------------


def test_mapped_arena_and_client_mapping_share_bytes(stores):
    store = stores.make()
    run(put(store, [0]))
    device, host = store.descriptors(G)
    assert (device.tier, host.tier) == ("device", "host")
    assert device.slot_bytes == host.slot_bytes == round_up(PAGE_BYTES)
    assert device.num_slots == host.num_slots == 2
    assert device.shm_path.startswith(SHM_DIR + "/") and device.cuda_handle is None
    mapping = ArenaMapping(device)
    slot = store.pool(G).index[key(0)].slot
    assert as_page(mapping.view(slot)).equal(page(0))
    mapping.view(1)[:4].copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    assert store.pool(G).memory[DEVICE].view(1)[:4].tolist() == [1, 2, 3, 4]


def test_new_store_removes_stale_slabs_of_its_prefix(stores):
    config = stores.config()
    stale = os.path.join(SHM_DIR, f"{config.limits.shm_prefix}-host-deadbeef")
    with open(stale, "wb") as handle:
        handle.write(b"x")
    stores.make(config)
    assert not os.path.exists(stale)


def test_close_unlinks_every_slab(stores):
    store = stores.make()
    run(put(store, [0]))
    store.pool(PageGeometry((1, 2, 1, 16, 16), "float32"))
    prefix = store.config.limits.shm_prefix
    assert len(shm_files(prefix)) == 4
    store.close()
    assert shm_files(prefix) == []
