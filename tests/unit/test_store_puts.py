"""NodeStore's puts: the top tier, cascades and events, reservations (dedup, abort, expiry: a
client that dies mid-put), Ray-style put_pages/map_pages and prefetch. Pure asyncio, no Ray.

The harness (Stores, puts into reserved slots, tiers, count_reads) is tests/unit/_pool_harness.py.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from cluster.core.geometry import DEVICE, DISK, HOST
from cluster.core.pool import State
from tests.unit._pages import (
    GEOMETRY,
    PAGE_BYTES,
    key,
    page,
)
from tests.unit._pool_harness import (
    as_raw,
    assert_slots_consistent,
    read_pages,
    run,
    store_put,
    store_put_each,
    tiers,
    write_pages,
)

G = GEOMETRY


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
