"""NodeStore's reads: read leases and pins, shared disk reads, round trips through the disk, and
disk recovery after a restart (a corrupted page is a miss). Pure asyncio, no Ray.

The harness (Stores, puts into reserved slots, tiers, count_reads) is tests/unit/_pool_harness.py.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
import torch

from cluster.core.geometry import DEVICE, DISK, HOST
from cluster.core.store import StoreConfig
from tests.unit._pages import (
    GEOMETRY,
    as_page,
    flip_disk_byte,
    key,
    page,
)
from tests.unit._pool_harness import (
    Stores,
    as_raw,
    count_reads,
    read_pages,
    run,
    store_put,
    store_put_each,
    tiers,
)

G = GEOMETRY


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
    assert store.stats()["disk_read_s"] > 0  # the read's wall time, for bench ttft's phases
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
